//! Cutting a prompt into fixed-length chunks.
//!
//! NPU graphs are static-shape and costly to prepare, so the prompt is processed in chunks of one
//! fixed length: every graph whose shape depends only on the chunk length (linear layers, FFN) is
//! prepared once and shared by all chunks. What does not fill a last chunk is either padded to the
//! chunk length (padded rows are computed but never enter the KV cache or the logits) or, as
//! HeteroLLM does, run as a *margin* on the CPU, concurrently with the NPU's full chunks.

use crate::error::{Error, Result};

/// One chunk: prompt positions `start..start + len`, run as `padded_len` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Position of the chunk in [`ChunkPlan::chunks`].
    pub index: usize,
    /// First prompt position of the chunk.
    pub start: usize,
    /// Real tokens in the chunk.
    pub len: usize,
    /// Rows the stages run on: the chunk length for an NPU chunk, `len` for a margin.
    pub padded_len: usize,
    /// Runs every stage on the CPU (see [`Tail::Margin`]).
    pub margin: bool,
}

impl Chunk {
    /// Rows computed beyond the chunk's tokens (only a padded last chunk has any).
    pub fn padding(&self) -> usize {
        self.padded_len - self.len
    }
}

/// What happens to the tokens that do not fill a last chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Tail {
    /// Padded to a whole chunk on the NPU: the NPU computes rows nobody uses (a 24-token
    /// prompt costs a 256-row chunk).
    Pad,
    /// Run on the CPU as a margin chunk of their own length (HeteroLLM): no padding; the CPU
    /// takes the margin's linears while the NPU runs the full chunks' stages.
    #[default]
    Margin,
}

/// A prompt cut into chunks: whole chunks of the graph sizes, then the rest padded or run as a CPU
/// margin ([`Tail`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlan {
    /// Tokens in the prompt: the chunks' `len`s add up to it.
    pub prompt_len: usize,
    /// The largest graph size.
    pub chunk_len: usize,
    /// The chunks in prompt order; only the last may be padded or a margin.
    pub chunks: Vec<Chunk>,
}

impl ChunkPlan {
    /// Plan `prompt_len` tokens in chunks of `chunk_len`, for a model with `context_len`
    /// positions, the remainder padded or run as a CPU margin.
    pub fn new(prompt_len: usize, chunk_len: usize, context_len: usize, tail: Tail) -> Result<Self> {
        Self::with_sizes(prompt_len, &[chunk_len], context_len, tail)
    }

    /// Plan with several graph sizes (HeteroLLM's multi-size graphs): as many chunks of the
    /// largest size as fit, then of the next, and so on; what is shorter than the smallest size
    /// is padded to it or run as a CPU margin. E.g. 300 tokens with sizes 256 and 32: one chunk
    /// of 256, one of 32 and a margin of 12.
    pub fn with_sizes(prompt_len: usize, sizes: &[usize], context_len: usize, tail: Tail) -> Result<Self> {
        if prompt_len == 0 {
            return Err(Error::Input("empty prompt: prefill needs at least one token".into()));
        }
        if sizes.is_empty() || sizes.contains(&0) {
            return Err(Error::Input(format!("chunk length 0 or none in {sizes:?}: use positive lengths (e.g. --chunk-len 256)")));
        }
        if prompt_len > context_len {
            return Err(Error::Input(format!("prompt of {prompt_len} tokens is longer than the model's context of {context_len} tokens")));
        }
        let mut sizes = sizes.to_vec();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        sizes.dedup();
        let mut chunks: Vec<Chunk> = vec![];
        let mut start = 0;
        for &size in &sizes {
            while prompt_len - start >= size {
                chunks.push(Chunk { index: chunks.len(), start, len: size, padded_len: size, margin: false });
                start += size;
            }
        }
        if start < prompt_len {
            let (len, smallest) = (prompt_len - start, sizes[sizes.len() - 1]);
            let margin = tail == Tail::Margin;
            chunks.push(Chunk { index: chunks.len(), start, len, padded_len: if margin { len } else { smallest }, margin });
        }
        Ok(ChunkPlan { prompt_len, chunk_len: sizes[0], chunks })
    }

    /// The graph sizes the plan's NPU chunks use.
    pub fn npu_sizes(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.chunks.iter().filter(|c| !c.margin).map(|c| c.padded_len).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Padding rows over all chunks: NPU work spent on no token.
    pub fn padded_tokens(&self) -> usize {
        self.chunks.iter().map(Chunk::padding).sum()
    }

    /// Rows run on the CPU as a margin.
    pub fn margin_tokens(&self) -> usize {
        self.chunks.iter().filter(|c| c.margin).map(|c| c.len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_multiple_has_no_padding() {
        for tail in [Tail::Pad, Tail::Margin] {
            let p = ChunkPlan::new(512, 256, 8192, tail).unwrap();
            assert_eq!(p.chunks.len(), 2);
            assert_eq!((p.padded_tokens(), p.margin_tokens()), (0, 0));
            assert_eq!(p.chunks[1], Chunk { index: 1, start: 256, len: 256, padded_len: 256, margin: false });
        }
    }

    #[test]
    fn last_chunk_is_padded() {
        let p = ChunkPlan::new(300, 128, 8192, Tail::Pad).unwrap();
        assert_eq!(p.chunks.iter().map(|c| c.len).collect::<Vec<_>>(), vec![128, 128, 44]);
        assert_eq!(p.chunks[2].padding(), 84);
        assert_eq!(p.chunks.iter().map(|c| c.len).sum::<usize>(), 300);
    }

    #[test]
    fn remainder_becomes_a_cpu_margin_without_padding() {
        let p = ChunkPlan::new(300, 128, 8192, Tail::Margin).unwrap();
        assert_eq!(p.chunks.iter().map(|c| (c.len, c.padded_len, c.margin)).collect::<Vec<_>>(), vec![(128, 128, false), (128, 128, false), (44, 44, true)]);
        assert_eq!((p.padded_tokens(), p.margin_tokens()), (0, 44));
        let p = ChunkPlan::new(24, 256, 8192, Tail::Margin).unwrap();
        assert_eq!(p.chunks, vec![Chunk { index: 0, start: 0, len: 24, padded_len: 24, margin: true }]);
    }

    #[test]
    fn one_token_and_chunk_longer_than_prompt() {
        let p = ChunkPlan::new(1, 256, 8192, Tail::Pad).unwrap();
        assert_eq!(p.chunks, vec![Chunk { index: 0, start: 0, len: 1, padded_len: 256, margin: false }]);
    }

    #[test]
    fn several_sizes_fill_from_the_largest() {
        let p = ChunkPlan::with_sizes(300, &[32, 256], 8192, Tail::Margin).unwrap();
        assert_eq!(
            p.chunks.iter().map(|c| (c.start, c.len, c.padded_len, c.margin)).collect::<Vec<_>>(),
            vec![(0, 256, 256, false), (256, 32, 32, false), (288, 12, 12, true)]
        );
        assert_eq!((p.chunk_len, p.padded_tokens(), p.margin_tokens(), p.npu_sizes()), (256, 0, 12, vec![32, 256]));
        let p = ChunkPlan::with_sizes(100, &[256, 32], 8192, Tail::Pad).unwrap();
        assert_eq!(p.chunks.iter().map(|c| (c.len, c.padded_len)).collect::<Vec<_>>(), vec![(32, 32), (32, 32), (32, 32), (4, 32)]);
        assert_eq!(p.padded_tokens(), 28);
        assert!(ChunkPlan::with_sizes(10, &[], 8192, Tail::Pad).is_err());
        assert!(ChunkPlan::with_sizes(10, &[32, 0], 8192, Tail::Pad).is_err());
    }

    #[test]
    fn bad_inputs_are_errors() {
        let t = Tail::Margin;
        assert!(ChunkPlan::new(0, 256, 8192, t).unwrap_err().to_string().contains("empty prompt"));
        assert!(ChunkPlan::new(10, 0, 8192, t).unwrap_err().to_string().contains("chunk length 0"));
        let e = ChunkPlan::new(9000, 256, 8192, t).unwrap_err().to_string();
        assert!(e.contains("9000") && e.contains("8192"), "{e}");
        assert!(ChunkPlan::new(8192, 256, 8192, t).is_ok());
    }
}
