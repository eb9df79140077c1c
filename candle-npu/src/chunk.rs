//! Cutting a prompt into fixed-length chunks.
//!
//! NPU graphs are static-shape and costly to prepare, so the prompt is processed in chunks of one
//! fixed length: every graph whose shape depends only on the chunk length (linear layers, FFN) is
//! prepared once and shared by all chunks. The last chunk is padded to the chunk length; padded
//! rows are computed but never enter the KV cache or the logits.

use crate::error::{Error, Result};

/// One chunk: prompt positions `start..start + len`, run as `padded_len` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub index: usize,
    pub start: usize,
    /// Real tokens in the chunk.
    pub len: usize,
    /// Rows the static graphs run on (the chunk length).
    pub padded_len: usize,
}

impl Chunk {
    pub fn padding(&self) -> usize {
        self.padded_len - self.len
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlan {
    pub prompt_len: usize,
    pub chunk_len: usize,
    pub chunks: Vec<Chunk>,
}

impl ChunkPlan {
    /// Plan `prompt_len` tokens in chunks of `chunk_len`, for a model with `context_len` positions.
    pub fn new(prompt_len: usize, chunk_len: usize, context_len: usize) -> Result<Self> {
        if prompt_len == 0 {
            return Err(Error::Input("empty prompt: prefill needs at least one token".into()));
        }
        if chunk_len == 0 {
            return Err(Error::Input("chunk length 0: use a positive --chunk-len (e.g. 256)".into()));
        }
        if prompt_len > context_len {
            return Err(Error::Input(format!(
                "prompt of {prompt_len} tokens is longer than the model's context of {context_len} tokens"
            )));
        }
        let chunks = (0..prompt_len.div_ceil(chunk_len))
            .map(|index| {
                let start = index * chunk_len;
                Chunk { index, start, len: chunk_len.min(prompt_len - start), padded_len: chunk_len }
            })
            .collect();
        Ok(ChunkPlan { prompt_len, chunk_len, chunks })
    }

    pub fn padded_tokens(&self) -> usize {
        self.chunks.iter().map(Chunk::padding).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_multiple_has_no_padding() {
        let p = ChunkPlan::new(512, 256, 8192).unwrap();
        assert_eq!(p.chunks.len(), 2);
        assert_eq!(p.padded_tokens(), 0);
        assert_eq!(p.chunks[1], Chunk { index: 1, start: 256, len: 256, padded_len: 256 });
    }

    #[test]
    fn last_chunk_is_padded() {
        let p = ChunkPlan::new(300, 128, 8192).unwrap();
        assert_eq!(p.chunks.iter().map(|c| c.len).collect::<Vec<_>>(), vec![128, 128, 44]);
        assert_eq!(p.chunks[2].padding(), 84);
        assert_eq!(p.chunks.iter().map(|c| c.len).sum::<usize>(), 300);
    }

    #[test]
    fn one_token_and_chunk_longer_than_prompt() {
        let p = ChunkPlan::new(1, 256, 8192).unwrap();
        assert_eq!(p.chunks, vec![Chunk { index: 0, start: 0, len: 1, padded_len: 256 }]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(ChunkPlan::new(0, 256, 8192).unwrap_err().to_string().contains("empty prompt"));
        assert!(ChunkPlan::new(10, 0, 8192).unwrap_err().to_string().contains("chunk length 0"));
        let e = ChunkPlan::new(9000, 256, 8192).unwrap_err().to_string();
        assert!(e.contains("9000") && e.contains("8192"), "{e}");
        assert!(ChunkPlan::new(8192, 256, 8192).is_ok());
    }
}
