//! Which graphs share a QNN context: the policy ([`Contexts`]), the units a context never cuts
//! (a layer's stage graphs of every size, which share weights), and the NPU address-space budget
//! that splits a model's contexts by layer range.
//!
//! # Why a budget
//!
//! A context's graphs live in one protection domain (PD) of the DSP, whose address space is
//! about 3.5 GB; when a context loads, the library reserves its "context size estimate" in a PD
//! and refuses the context (QNN 1002, "Failed to find available PD ... with context size
//! estimate N") if no PD has that much left. On a phone the library opens further PDs as one
//! fills ("PD0 exhausted triggering on next_PD"), so a model of any size loads if each of its
//! contexts fits one PD: an 8B model's weights alone (7.5 GB in INT8) need three. The x86
//! emulator has one PD per process ("Router.X86 does not support multi-PD"), of 3,650,722,201
//! bytes (the reservation of Qwen2.5-Coder's 256-row context, 3,254,679,552, plus what it
//! reported left, 396,042,649), and its graph prepare runs with `memory_alloc_limit = 3584`
//! (MB). The default budget, [`DEFAULT_CONTEXT_BUDGET`], is 3400 MiB, under both.
//!
//! # The estimate
//!
//! The library's estimate of a context is the sum of its graphs' (checked: Qwen2.5-Coder's 96
//! graphs at 256 rows, 24 x 129.33 = 3103.9 MB), each of them VTCM (8 MiB on SM8650) + I/O
//! tensors + run list + constants, the constants allocated in 2 MiB steps, all read from the
//! library's verbose log (`RUST_LOG=candle_npu::qnn=trace`). Before a graph is built only its
//! I/O bytes (exactly the library's) and its constant bytes are known, so [`address_space`]
//! bounds the rest from them: run list <= 2.25 x I/O, constants <= 2 x weights + 4 x I/O (the
//! W8A8 gate/up graphs at 256 rows hold constants that grow with the rows, 48 MiB for
//! Qwen2.5-Coder's 8.7 MB of weights). Over the three real models' stage graphs at 32 and 256
//! rows the bound is 1.00-1.77x the library's figure (`tests/htp_context_budget.rs` checks it on
//! the library). With weight sharing a unit's weights are counted once per graph, not once: an
//! over-estimate (the x86 library cannot load a shared context, so what it would reserve for one
//! is not measured).

use crate::error::{Error, Result};
use crate::graph::Graph;

/// How graphs prepared together are held in QNN contexts ([`super::htp::HtpConfig::contexts`]).
/// A context is one context binary in the cache and one `contextCreateFromBinary`; its graphs
/// are found in it with `graphRetrieve`. Whatever the policy, a context whose estimate would
/// exceed [`super::htp::HtpConfig::context_budget`] is split by layer range (see the module
/// documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contexts {
    /// A context per graph, as [`super::Executor::prepare`] does: for measuring the difference.
    PerGraph,
    /// A context per graph size (row count). Without weight sharing (the x86 emulator, HTP
    /// before v73) a context of every size saves no memory (SmolLM2 at 256 + 32 rows: 483 MB of
    /// binary against 486 MB in 240 contexts) and needs the more address space at once.
    PerGraphSize,
    /// One context for all of them: with [`super::htp::HtpConfig::weight_sharing`], the sizes'
    /// copies of a weight are held once (SmolLM2 at 256 + 32 rows: 118 MB of binary).
    PerModel,
}

/// [`super::htp::HtpConfig::context_budget`]'s default: 3400 MiB, under the emulator's PD
/// (3481.6 MiB) and the library's `memory_alloc_limit` (3584 MB); see the module documentation.
pub const DEFAULT_CONTEXT_BUDGET: u64 = 3400 << 20;

/// VTCM the library reserves per graph when the config sets none: SM8650's 8 MiB (the most of
/// any SoC this crate names, so never an under-estimate).
const DEFAULT_VTCM: u64 = 8 << 20;

/// The library allocates a graph's constants in steps of this many bytes.
const CONST_STEP: u64 = 2 << 20;

/// An upper bound of the NPU address space the library reserves for `graph` when its context
/// loads ("estimated PD size"), from its I/O and constant bytes; `vtcm_mb` is the config's
/// (`None` or 0: the SoC's, at most 8 MiB). See the module documentation for the terms.
pub fn address_space(graph: &Graph, vtcm_mb: Option<u32>) -> u64 {
    let vtcm = match vtcm_mb {
        Some(mb) if mb > 0 => u64::from(mb) << 20,
        _ => DEFAULT_VTCM,
    };
    let bytes = |ids: &[crate::graph::TensorId]| ids.iter().map(|&id| graph.tensor(id).size_in_bytes() as u64).sum::<u64>();
    let io = bytes(&graph.inputs) + bytes(&graph.outputs);
    let consts: u64 = graph.tensors.iter().filter(|t| t.data.is_some()).map(|t| t.size_in_bytes() as u64).sum();
    let run_list = io * 9 / 4;
    let constants = (2 * consts + 4 * io).div_ceil(CONST_STEP) * CONST_STEP;
    vtcm + io + run_list + constants
}

/// What the plan needs of a graph: its row count (first input's first dimension), the identities
/// of its constants ([`crate::graph::TensorSpec::data_id`]) and its [`address_space`].
#[derive(Debug, Clone)]
pub(crate) struct Member {
    pub name: String,
    pub rows: Option<usize>,
    pub data_ids: Vec<u64>,
    pub need: u64,
}

impl Member {
    pub fn of(graph: &Graph, vtcm_mb: Option<u32>) -> Self {
        Member {
            name: graph.name.clone(),
            rows: graph.inputs.first().and_then(|&t| graph.tensor(t).shape.first().copied()),
            data_ids: graph.tensors.iter().filter_map(|t| t.data_id).collect(),
            need: address_space(graph, vtcm_mb),
        }
    }
}

/// The contexts of `members` (indices, each ascending): grouped as `contexts` says, then each
/// group cut, in order, into runs of whole units whose [`address_space`] sums to at most
/// `budget`. A unit is the graphs linked by a shared constant (a layer's stage at every size),
/// in the order of its first graph, so runs are layer ranges. A unit over the budget alone is
/// cut into its graphs (its weights are then held per context; logged); a graph over it is an
/// [`Error::Input`] naming it.
pub(crate) fn plan(members: &[Member], contexts: Contexts, budget: u64) -> Result<Vec<Vec<usize>>> {
    if let Some(m) = members.iter().find(|m| m.need > budget) {
        return Err(Error::Input(format!(
            "graph '{}' needs up to {} MiB of the NPU's address space, more than the context budget of {} MiB \
             (HtpConfig::context_budget): raise the budget or prepare graphs of fewer rows",
            m.name,
            m.need >> 20,
            budget >> 20
        )));
    }
    let groups: Vec<Vec<usize>> = match contexts {
        Contexts::PerGraph => return Ok((0..members.len()).map(|i| vec![i]).collect()),
        Contexts::PerModel => vec![(0..members.len()).collect()],
        Contexts::PerGraphSize => {
            let mut groups: Vec<(Option<usize>, Vec<usize>)> = Vec::new();
            for (i, m) in members.iter().enumerate() {
                match groups.iter_mut().find(|(r, _)| *r == m.rows) {
                    Some((_, g)) => g.push(i),
                    None => groups.push((m.rows, vec![i])),
                }
            }
            groups.into_iter().map(|(_, g)| g).collect()
        }
    };
    let mut out = Vec::new();
    for group in groups {
        let mut current: Vec<usize> = Vec::new();
        let mut used = 0u64;
        for unit in units(members, &group) {
            let need: u64 = unit.iter().map(|&i| members[i].need).sum();
            // A unit over the budget goes graph by graph; a whole one, as one piece.
            let pieces: Vec<Vec<usize>> = if need > budget {
                tracing::warn!(
                    graphs = unit.len(), first = %members[unit[0]].name, need_mib = need >> 20, budget_mib = budget >> 20,
                    "graphs sharing weights do not fit one NPU context together: split, each context holding its own copy"
                );
                unit.iter().map(|&i| vec![i]).collect()
            } else {
                vec![unit]
            };
            for piece in pieces {
                let need: u64 = piece.iter().map(|&i| members[i].need).sum();
                if used + need > budget && !current.is_empty() {
                    out.push(std::mem::take(&mut current));
                    used = 0;
                }
                current.extend(piece);
                used += need;
            }
        }
        if !current.is_empty() {
            out.push(current);
        }
    }
    for c in &mut out {
        c.sort_unstable();
    }
    Ok(out)
}

/// `group` (member indices) cut into units: graphs linked by a shared constant identity, in the
/// order of their first member.
fn units(members: &[Member], group: &[usize]) -> Vec<Vec<usize>> {
    let mut unit_of: Vec<usize> = (0..group.len()).collect();
    fn root(u: &mut [usize], mut i: usize) -> usize {
        while u[i] != i {
            u[i] = u[u[i]];
            i = u[i];
        }
        i
    }
    let mut first_with: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    for (pos, &i) in group.iter().enumerate() {
        for &id in &members[i].data_ids {
            match first_with.get(&id) {
                Some(&other) => {
                    let (a, b) = (root(&mut unit_of, pos), root(&mut unit_of, other));
                    unit_of[a.max(b)] = a.min(b);
                }
                None => {
                    first_with.insert(id, pos);
                }
            }
        }
    }
    let mut units: Vec<(usize, Vec<usize>)> = Vec::new();
    for (pos, &i) in group.iter().enumerate() {
        let r = root(&mut unit_of, pos);
        match units.iter_mut().find(|(root, _)| *root == r) {
            Some((_, u)) => u.push(i),
            None => units.push((r, vec![i])),
        }
    }
    units.into_iter().map(|(_, u)| u).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `layers` layers of `stages` stages at each of `sizes`, in the order a model describes
    /// them (size-major), each stage's weight one identity across sizes; each graph needs
    /// `need(rows)`.
    fn model(layers: usize, stages: usize, sizes: &[usize], need: impl Fn(usize) -> u64) -> Vec<Member> {
        let mut out = Vec::new();
        for &rows in sizes {
            for l in 0..layers {
                for s in 0..stages {
                    let id = (l * stages + s) as u64;
                    out.push(Member { name: format!("blk.{l}.{s}.m{rows}"), rows: Some(rows), data_ids: vec![id], need: need(rows) });
                }
            }
        }
        out
    }

    fn layers_of(members: &[Member], context: &[usize]) -> Vec<usize> {
        let mut l: Vec<usize> = context.iter().map(|&i| members[i].name.split('.').nth(1).unwrap().parse().unwrap()).collect();
        l.sort_unstable();
        l.dedup();
        l
    }

    #[test]
    fn a_model_over_the_budget_is_cut_into_layer_ranges_holding_every_size() {
        // 10 layers of 4 stages at 256 and 32 rows: 10 + 2 MiB a stage, 48 MiB a layer.
        let mib = 1u64 << 20;
        let members = model(10, 4, &[256, 32], |rows| if rows == 256 { 10 * mib } else { 2 * mib });
        let plan = plan(&members, Contexts::PerModel, 100 * mib).unwrap();
        // Two layers (96 MiB) fit, a third does not: five contexts of two layers each.
        assert_eq!(plan.len(), 5);
        for (c, context) in plan.iter().enumerate() {
            assert_eq!(layers_of(&members, context), vec![2 * c, 2 * c + 1]);
            assert_eq!(context.len(), 16, "both sizes of both layers");
            assert!(context.iter().map(|&i| members[i].need).sum::<u64>() <= 100 * mib);
        }
        // Within budget: one context, as before.
        assert_eq!(super::plan(&members, Contexts::PerModel, 480 * mib).unwrap(), vec![(0..80).collect::<Vec<_>>()]);
        // Per size: each size's group is cut on its own; graphs sharing no weights within it are
        // units of their own (ten 10 MiB graphs a context).
        let per_size = super::plan(&members, Contexts::PerGraphSize, 100 * mib).unwrap();
        assert_eq!(per_size.iter().map(Vec::len).collect::<Vec<_>>(), vec![10, 10, 10, 10, 40]);
        assert!(per_size.iter().all(|c| c.iter().map(|&i| members[i].need).sum::<u64>() <= 100 * mib));
    }

    #[test]
    fn a_unit_over_the_budget_goes_graph_by_graph_and_a_graph_over_it_is_refused() {
        let mib = 1u64 << 20;
        let members = model(2, 2, &[256, 32], |rows| if rows == 256 { 30 * mib } else { 20 * mib });
        // A stage at both sizes needs 50 MiB; a 40 MiB budget takes one graph a context.
        let plan = plan(&members, Contexts::PerModel, 40 * mib).unwrap();
        assert_eq!(plan.len(), members.len());
        let err = super::plan(&members, Contexts::PerModel, 25 * mib).unwrap_err().to_string();
        assert!(err.contains("graph 'blk.0.0.m256' needs up to 30 MiB") && err.contains("budget of 25 MiB"), "{err}");
    }

    #[test]
    fn graphs_are_grouped_by_policy() {
        let members = model(2, 1, &[64, 32], |_| 1);
        assert_eq!(plan(&members, Contexts::PerGraphSize, u64::MAX).unwrap(), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(plan(&members, Contexts::PerModel, u64::MAX).unwrap(), vec![vec![0, 1, 2, 3]]);
        assert_eq!(plan(&members, Contexts::PerGraph, u64::MAX).unwrap(), vec![vec![0], vec![1], vec![2], vec![3]]);
    }

    #[test]
    fn the_estimate_counts_io_and_constants() {
        use crate::graph::{DType, Quant, StaticData};
        use std::sync::Arc;
        // x [256, 896] u8 -> FC with an [1152, 896] i8 weight -> y [256, 1152] f32.
        let mut g = Graph::new("fc");
        let x = g.input("x", &[256, 896], DType::U8, Some(Quant { scale: 0.1, offset: -128 }));
        let w = g.constant("w", &[1152, 896], StaticData::I8(Arc::new(vec![1; 1152 * 896])), Some(Quant { scale: 0.01, offset: 0 }));
        let y = g.fully_connected("y", x, w, None, DType::F32, None);
        g.mark_output(y);
        let io = 256 * 896 + 256 * 1152 * 4;
        let consts = 1152 * 896u64;
        let want = (8 << 20) + io + io * 9 / 4 + (2 * consts + 4 * io).div_ceil(2 << 20) * (2 << 20);
        assert_eq!(address_space(&g, None), want);
        assert_eq!(address_space(&g, Some(4)), want - (4 << 20));
    }
}
