//! Speculative decoding: tokens proposed cheaply are verified several at a time, in one pass over
//! the weights ([`crate::Model::decode_rows`]); decode is memory-bound, so a pass of a few rows
//! costs little more than one.
//!
//! # Why the output is the plain decode's, token for token
//!
//! A verifier's row `i` holds the logits [`crate::Model::decode`] would give after the same
//! tokens, bit for bit (the same kernels per row). The generation loop samples every token from
//! such a row, exactly as without speculation (the same sampler, the same random numbers, the
//! same repeat penalty over the same history), and only then looks whether the proposal guessed
//! it: a guessed token's next row is already computed; at the first miss the rows after it are
//! dropped ([`crate::Model::rewind`]). So greedy and sampled output are the plain decode's.
//!
//! For a proposer that proposes one token per position (a point mass, as prompt lookup and a
//! greedy draft are), sampling then matching *is* the standard acceptance rule of speculative
//! sampling (Leviathan et al., 2023): the proposal `d` is kept with probability `p(d)`, and on a
//! miss the token comes from `p` without `d`, renormalized, which is `(p - q)+` for `q` a point
//! mass on `d`.
//!
//! # Proposers
//!
//! [`Speculative::Lookup`]: prompt lookup. The conversation's last n tokens (n from the largest
//! to the smallest n-gram size) are looked for earlier in the conversation, latest match first,
//! and the tokens that followed are proposed: free, and right where an answer copies its input
//! (quoting a document, rewriting code). The number proposed adapts to how many were accepted.

use candle_npu::{Error, Result};

/// How [`crate::GenerateOptions`] proposes tokens to verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Speculative {
    /// No speculation: one decode step per token.
    #[default]
    Off,
    /// Prompt lookup (see the [module](self)): the tokens that followed the latest earlier
    /// occurrence of the conversation's last `ngram_max` down to `ngram_min` tokens, at most
    /// `max_draft` of them per pass.
    Lookup {
        /// Largest n-gram looked for (3 by default).
        ngram_max: usize,
        /// Smallest n-gram looked for (2 by default: single tokens recur everywhere, and a
        /// match of one says little about what follows).
        ngram_min: usize,
        /// Most tokens verified in one pass besides the sampled one (8 by default).
        max_draft: usize,
    },
}

impl Speculative {
    /// Prompt lookup with the default sizes.
    pub fn lookup() -> Self {
        Speculative::Lookup { ngram_max: 3, ngram_min: 2, max_draft: 8 }
    }

    /// Checks the sizes, before any work.
    pub fn validate(&self) -> Result<()> {
        match *self {
            Speculative::Off => Ok(()),
            Speculative::Lookup { ngram_max, ngram_min, max_draft } => {
                if ngram_min == 0 || ngram_min > ngram_max {
                    return Err(Error::Input(format!("prompt lookup n-grams {ngram_min}..={ngram_max}: expected 1 <= min <= max")));
                }
                if max_draft == 0 || max_draft > MAX_DRAFT {
                    return Err(Error::Input(format!("prompt lookup of {max_draft} tokens per pass: expected 1 to {MAX_DRAFT}")));
                }
                Ok(())
            }
        }
    }
}

/// The most tokens one verification pass takes (a pass's rows share each chunk of weights while
/// it is in cache; beyond 16 rows the kernels read the weights again).
pub const MAX_DRAFT: usize = 15;

/// Proposed and accepted tokens of one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Verification passes (each of the sampled token and at least one proposed).
    pub passes: usize,
    /// Tokens proposed.
    pub proposed: usize,
    /// Proposed tokens that were the ones sampled.
    pub accepted: usize,
}

/// Prompt lookup's state over one generation: the number of tokens to propose next, which grows
/// while proposals are accepted and shrinks when they are not.
pub(crate) struct Lookup {
    ngram_max: usize,
    ngram_min: usize,
    max_draft: usize,
    /// Tokens to propose at the next match.
    draft: usize,
}

impl Lookup {
    pub(crate) fn new(spec: Speculative) -> Option<Self> {
        match spec {
            Speculative::Off => None,
            Speculative::Lookup { ngram_max, ngram_min, max_draft } => Some(Lookup { ngram_max, ngram_min, max_draft, draft: max_draft.min(4) }),
        }
    }

    /// Up to the current draft length of tokens that followed the latest earlier occurrence of
    /// `tokens`' last n-gram (largest n first), at most `room`; none without a match.
    pub(crate) fn propose(&self, tokens: &[u32], room: usize) -> Vec<u32> {
        let want = self.draft.min(room);
        if want == 0 {
            return vec![];
        }
        for n in (self.ngram_min..=self.ngram_max).rev() {
            if let Some(follow) = find_latest(tokens, n) {
                return tokens[follow..(follow + want).min(tokens.len())].to_vec();
            }
        }
        vec![]
    }

    /// After a pass that proposed `proposed` tokens of which the first `accepted` were right:
    /// all right, propose more next time (up to the maximum); else as many as were right, and
    /// at least one.
    pub(crate) fn update(&mut self, proposed: usize, accepted: usize) {
        self.draft = match accepted == proposed {
            true => (self.draft * 2).min(self.max_draft),
            false => accepted.max(1),
        };
    }
}

/// Where the tokens after the latest earlier occurrence of `tokens`' last `n` tokens start:
/// `Some(i)` with `tokens[i - n..i]` equal to the suffix, `i < tokens.len()`, so that at least
/// one token follows.
fn find_latest(tokens: &[u32], n: usize) -> Option<usize> {
    let len = tokens.len();
    if n == 0 || len <= n {
        return None;
    }
    let suffix = &tokens[len - n..];
    // Candidate ends `i` from the latest (len - 1: the match ends just before the suffix's last
    // token) down to n.
    (n..len).rev().find(|&i| &tokens[i - n..i] == suffix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_proposes_what_followed_the_latest_match_of_the_longest_ngram() {
        let l = Lookup { ngram_max: 3, ngram_min: 1, max_draft: 8, draft: 4 };
        // "1 2 3 9 9 | 1 2 3 7 7 7 | 5 1 2 3": the latest "1 2 3" was followed by 7 7 7 5.
        let t = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 7, 5, 1, 2, 3];
        assert_eq!(l.propose(&t, 8), [7, 7, 7, 5]);
        assert_eq!(l.propose(&t, 2), [7, 7], "bounded by the room left");
        // No trigram match: the bigram "4 2" follows; no match at all: nothing.
        assert_eq!(l.propose(&[4, 2, 6, 8, 4, 2], 8), [6, 8, 4, 2]);
        assert!(l.propose(&[1, 2, 3, 4], 8).is_empty());
        let bigrams = Lookup { ngram_min: 2, ..l };
        assert!(bigrams.propose(&[5, 1, 6, 1], 8).is_empty(), "a single token's match is not taken");
        // The suffix overlapping its own match (a repeated token) still proposes what follows.
        assert_eq!(l.propose(&[7, 7, 7], 8), [7]);
    }

    #[test]
    fn the_draft_grows_while_accepted_and_shrinks_to_what_was() {
        let mut l = Lookup::new(Speculative::lookup()).unwrap();
        assert_eq!(l.draft, 4);
        l.update(4, 4);
        assert_eq!(l.draft, 8);
        l.update(8, 8);
        assert_eq!(l.draft, 8, "at most max_draft");
        l.update(8, 3);
        assert_eq!(l.draft, 3);
        l.update(3, 0);
        assert_eq!(l.draft, 1);
    }

    #[test]
    fn sizes_are_checked() {
        assert!(Speculative::lookup().validate().is_ok());
        for bad in [
            Speculative::Lookup { ngram_max: 3, ngram_min: 0, max_draft: 8 },
            Speculative::Lookup { ngram_max: 1, ngram_min: 2, max_draft: 8 },
            Speculative::Lookup { ngram_max: 3, ngram_min: 1, max_draft: 0 },
            Speculative::Lookup { ngram_max: 3, ngram_min: 1, max_draft: MAX_DRAFT + 1 },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
