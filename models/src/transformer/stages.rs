//! A layer's NPU stages as one value, [`STAGES`]: what loading, the layer forward, the prefill
//! DAG, the stage graphs' names, the quantization points, calibration and decode all read. A
//! stage is the linears that share one input and run as one static graph; the CPU work before
//! it prepares that input. Adding or splitting a stage is an edit of [`STAGES`] (and of the
//! layer forward's calls, which say what the CPU does between stages).

use super::Config;

/// A size of a linear's weight, in terms of the model's [`Config`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// The residual stream's width.
    Hidden,
    /// The FFN's inner width.
    Ffn,
    /// All query heads: `n_head * head_dim`.
    Query,
    /// All key (or value) heads: `n_kv_head * head_dim`.
    KeyValue,
}

impl Dim {
    /// The size in `cfg`'s model.
    pub fn of(self, cfg: &Config) -> usize {
        match self {
            Dim::Hidden => cfg.hidden,
            Dim::Ffn => cfg.ffn,
            Dim::Query => cfg.n_head * cfg.head_dim,
            Dim::KeyValue => cfg.n_kv_head * cfg.head_dim,
        }
    }
}

/// One linear of a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearDef {
    /// The checkpoint tensor, `blk.{layer}.{name}.weight` in the engine's (GGUF) names.
    pub name: &'static str,
    /// Output features (rows of the weight).
    pub out: Dim,
    /// Input features: the stage's input width.
    pub input: Dim,
    /// Carries a bias when the family has QKV biases ([`crate::FamilySpec::qkv_bias`]).
    pub qkv_bias: bool,
}

/// One NPU stage of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageDef {
    /// The stage graph's name, `blk.{layer}.{name}.m{rows}`, and its node in the prefill DAG.
    pub name: &'static str,
    /// The CPU node of the prefill DAG before this stage: it prepares the stage's input and
    /// completes the previous stage's output (shadow, bias).
    pub cpu: &'static str,
    /// Whether that CPU node reads the KV rows earlier chunks appended (attention): the only
    /// dependency between chunks.
    pub cpu_reads_kv: bool,
    /// The activation quantization point of the stage's input, `blk.{layer}.{point}` in a
    /// quant profile.
    pub point: &'static str,
    /// Its linears, in the order of the graph's outputs.
    pub linears: &'static [LinearDef],
}

const fn linear(name: &'static str, out: Dim, input: Dim, qkv_bias: bool) -> LinearDef {
    LinearDef { name, out, input, qkv_bias }
}

/// The stages of every layer, in the order the layer forward runs them.
pub const STAGES: &[StageDef] = &[
    StageDef {
        name: "qkv",
        cpu: "attn_in",
        cpu_reads_kv: false,
        point: "attn_in",
        linears: &[
            linear("attn_q", Dim::Query, Dim::Hidden, true),
            linear("attn_k", Dim::KeyValue, Dim::Hidden, true),
            linear("attn_v", Dim::KeyValue, Dim::Hidden, true),
        ],
    },
    StageDef { name: "o", cpu: "attn", cpu_reads_kv: true, point: "attn_out", linears: &[linear("attn_output", Dim::Hidden, Dim::Query, false)] },
    StageDef {
        name: "gate_up",
        cpu: "ffn_in",
        cpu_reads_kv: false,
        point: "ffn_in",
        linears: &[linear("ffn_gate", Dim::Ffn, Dim::Hidden, false), linear("ffn_up", Dim::Ffn, Dim::Hidden, false)],
    },
    StageDef { name: "down", cpu: "act", cpu_reads_kv: false, point: "ffn_down_in", linears: &[linear("ffn_down", Dim::Hidden, Dim::Ffn, false)] },
];

/// The names of a layer's linears (`attn_q`, ..., `ffn_down`), in [`STAGES`]' order.
pub fn linear_names() -> impl Iterator<Item = &'static str> {
    STAGES.iter().flat_map(|s| s.linears.iter().map(|l| l.name))
}

/// NPU stages per layer (stage graphs per layer and graph size).
pub const N_STAGES: usize = STAGES.len();

/// Indices into [`STAGES`] for the layer forward's calls.
pub(crate) const QKV: usize = 0;
pub(crate) const O: usize = 1;
pub(crate) const GATE_UP: usize = 2;
pub(crate) const DOWN: usize = 3;

/// Name of an activation quantization point.
pub fn point(layer: usize, which: &str) -> String {
    format!("blk.{layer}.{which}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_indices_name_their_stages() {
        let names: Vec<_> = [QKV, O, GATE_UP, DOWN].iter().map(|&s| STAGES[s].name).collect();
        assert_eq!(names, ["qkv", "o", "gate_up", "down"]);
    }

    #[test]
    fn a_stage_s_linears_share_its_input() {
        for s in STAGES {
            assert!(s.linears.iter().all(|l| l.input == s.linears[0].input), "stage {}", s.name);
        }
        // Points and graph names are keys: unique.
        let mut keys: Vec<_> = STAGES.iter().flat_map(|s| [s.point, s.name]).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), 2 * N_STAGES);
    }
}
