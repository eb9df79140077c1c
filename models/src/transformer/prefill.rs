//! Prefill: the chunk plan, the DAG of a prompt's stages, their schedule, the run loop over the
//! chunks (pools, the NPU's stage graphs and a margin's), and each chunk's NPU stages with their
//! shadow path.

use super::*;

/// Which stage graphs: the NPU's for chunks of one row count, or a CPU margin's (any row count;
/// see `Model::margin_graphs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum GraphSet {
    Npu(usize),
    Margin,
    /// One graph per layer ([`Model::layer_graph`]) for chunks of `m` rows over a cache of `cap`.
    Layers {
        m: usize,
        cap: usize,
    },
}

/// What [`Model::prefill_sequence`] runs and returns (every field has a default: the model's
/// chunk length, its prefill plan's rows, the last token's logits).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefillOptions {
    /// Rows of the NPU graphs the tokens are cut into (`None`: [`Model::chunk_len`]).
    pub chunk_len: Option<usize>,
    /// Which logits come back.
    pub logits: Logits,
    /// Which rows run on the NPU's graphs.
    pub rows: PrefillRows,
}

impl PrefillOptions {
    /// In chunks of `chunk_len` rows (for measurements across chunk lengths).
    pub fn chunked(chunk_len: usize) -> Self {
        PrefillOptions { chunk_len: Some(chunk_len), ..Default::default() }
    }

    /// Every token's logits, `[n, vocab]` (perplexity, a verifier's rows).
    pub fn all_logits(self) -> Self {
        PrefillOptions { logits: Logits::All, ..self }
    }

    /// These rows on the NPU's graphs: [`PrefillRows::NpuOnly`] for a verifier on the NPU,
    /// [`PrefillRows::Cpu`] for candle's own CPU prefill.
    pub fn rows(self, rows: PrefillRows) -> Self {
        PrefillOptions { rows, ..self }
    }
}

/// Which logits a prefill returns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Logits {
    /// The last token's, `[vocab]`: a prompt's next token.
    #[default]
    Last,
    /// Every token's, `[n, vocab]`: perplexity, a speculative verifier's rows.
    All,
}

/// Which rows of a prefill run on the NPU's graphs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PrefillRows {
    /// As the model's plan says ([`Model::plan_chunked`]: full chunks, smaller graphs where
    /// they pay, the rest a CPU margin or padded).
    #[default]
    Planned,
    /// Every row on graphs of the chunk length, the last chunk padded, no CPU margin: each row
    /// is what the NPU gives it (a speculative verifier on the NPU, measurements of its
    /// numerics).
    NpuOnly,
    /// Every row on the CPU with the decode weights, no graph and no profile: candle's own CPU
    /// prefill, the baseline the NPU's is measured against, and a draft model's catch-up.
    Cpu,
}

/// How prefill is scheduled (llm.npu §3.4 and HeteroLLM's margin). The defaults were chosen by
/// measurement (`docs/scheduling.md`): FIFO, 4 chunks in flight, graphs of
/// the chunk length and of 32 rows, the rest a CPU margin with the host executor
/// ([`SchedOptions::default`]) or padded beside a real NPU ([`SchedOptions::for_device`]).
#[derive(Debug, Clone)]
pub struct SchedOptions {
    /// Which ready stage a free processor runs next.
    pub policy: Policy,
    /// Tokens that do not fill a last chunk (of the smallest size): padded on the NPU or run on
    /// the CPU as a margin.
    pub tail: Tail,
    /// Threads of the pool the NPU stages run in (`None`: the caller's, i.e. rayon's global
    /// pool). With the host executor as the NPU, `Some(1)` gives it one core and leaves the
    /// other to the CPU stages (run with `RAYON_NUM_THREADS=1` so candle's CPU kernels take one).
    pub npu_threads: Option<usize>,
    /// Graph sizes smaller than the chunk length the plan may also use (HeteroLLM's multi-size
    /// graphs, each prepared once and cached): where the cost model predicts it is faster, the
    /// rows after the last full chunk run in chunks of these sizes before a margin is left.
    pub small_chunks: Vec<usize>,
    /// Chunks an out-of-order prefill works on at once: its worker threads, each walking one
    /// chunk's stages. Fewer limit how far the NPU can run ahead of attention (FIFO at 2048
    /// tokens, a core each: 2 give 117 tok/s, 4 give 167, all 8 give 174); each is a thread with
    /// its own heap arena unless the program shares them ([`crate::memory::limit_malloc_arenas`]).
    pub chunks_in_flight: usize,
    /// What one NPU graph holds: llm.npu's four stages per layer with the CPU between them, or
    /// a whole layer ([`PrefillPlan`]).
    pub plan: PrefillPlan,
}

/// How a prefill's layers are cut into NPU graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillPlan {
    /// llm.npu's: per layer four graphs of linears (qkv, o, gate_up, down); norms, RoPE,
    /// attention, the activation, quantization and the shadow outliers on the CPU between them,
    /// chunks scheduled out of order across the two processors. Every precision.
    #[default]
    Stages,
    /// Issue 48's: each layer one graph ([`Model::layer_graph`]): norms, linears, RoPE,
    /// attention over a masked cache of fixed capacity, the FFN and the residual adds, the
    /// chunks in order, every row (the last chunk padded) on the NPU. F32, W8A16, or shadow
    /// W8A16 with its outliers through float weights inside the graph.
    Layers,
}

impl Default for SchedOptions {
    fn default() -> Self {
        SchedOptions { policy: Policy::Fifo, tail: Tail::Margin, npu_threads: None, small_chunks: vec![32], chunks_in_flight: 4, plan: PrefillPlan::Stages }
    }
}

impl SchedOptions {
    /// Why a model of `context_len` tokens cannot run this schedule, if it cannot: at least one
    /// chunk in flight, at least one NPU thread when a pool is asked for, and graph sizes of 1 row
    /// up to the context.
    pub fn validate(&self, context_len: usize) -> Result<()> {
        let bad = |why: String| Err(Error::Input(format!("schedule: {why}")));
        if self.chunks_in_flight == 0 {
            return bad("chunks_in_flight is 0: at least one chunk must be in flight".into());
        }
        if self.npu_threads == Some(0) {
            return bad("npu_threads is Some(0): give the NPU queue at least one thread, or None for the caller's pool".into());
        }
        if let Some(&s) = self.small_chunks.iter().find(|&&s| s == 0 || s > context_len) {
            return bad(format!("small chunk size {s}: expected 1 to the model's context of {context_len} tokens"));
        }
        Ok(())
    }

    /// The defaults for prefills of `precision` on `device`. With the host executor as the NPU, the rows after
    /// the last chunk are a CPU margin: the same arithmetic on the same cores, without padding.
    /// Beside a real NPU they are padded onto it (`Tail::Pad`), for two measured reasons:
    /// - **One arithmetic per prompt.** A margin computes its rows on the HTP numerics model,
    ///   which matches the library on 99.6% of stage outputs; the rest move logits by up to a
    ///   logit through 30 layers, enough to flip a near tie: the README's own question ("What is
    ///   the capital of France?", a 0.15-logit tie between "The" and "L'" at its first answer
    ///   token) answered "L'Étoile" with an HTP chunk and a margin, "Paris" with every row on the
    ///   HTP (`docs/accuracy.md`).
    /// - **Speed on a phone.** The phone cost model ([`Rates::SNAPDRAGON_8_GEN_3`], FIFO) puts the
    ///   CPU stages on the critical path and the NPU mostly idle, so rows padded onto the NPU cost
    ///   less than margin rows on the CPU in most cases: padded makespans are 0.23x (a 20-token
    ///   prompt, all margin otherwise) to 1.00x the margin's at 20-1500 tokens for SmolLM2,
    ///   Gemma 3 and Qwen2.5-Coder, two cases excepted (Qwen at 100 and 300 tokens: 1.14x and
    ///   1.03x); `examples/sched.rs --sections tail` prints the table (`docs/accuracy.md`).
    ///
    /// The plan: each layer one graph ([`PrefillPlan::Layers`]) on the HTP and on its numerics
    /// model, for every precision that has whole-layer graphs (all but W8A8); llm.npu's stages
    /// on the host executor, whose fastest plan they are (whole layers ran at 0.29-0.34x their
    /// speed there: SmolLM2, 1256 tokens, `docs/npu_layers.md`).
    pub fn for_device(device: &NpuDevice, precision: Precision) -> Self {
        let tail = if device.on_host() { Tail::Margin } else { Tail::Pad };
        let htp = device.numerics() == candle_npu::Numerics::Htp;
        let plan = if htp && precision.has_whole_layers() { PrefillPlan::Layers } else { PrefillPlan::Stages };
        SchedOptions { tail, plan, ..Default::default() }
    }

    /// Whether this plan can run `precision`: whole layers cannot run W8A8 (its outliers run on
    /// the CPU between the linears).
    pub fn check_precision(&self, precision: Precision) -> Result<()> {
        if self.plan == PrefillPlan::Layers && !precision.has_whole_layers() {
            return Err(Error::Input(
                "a whole-layer prefill plan (PrefillPlan::Layers, --plan layers) computes F32, W8A16 or shadow W8A16, not W8A8: choose one of those, or PrefillPlan::Stages".into(),
            ));
        }
        Ok(())
    }
}

/// A prefill chunk's rows for the logits and its shadow-path CPU time.
pub(super) type ChunkOutput = Result<(Tensor, Duration)>;

/// The DAG node of stage `s`'s CPU work (before the NPU stage) within a layer: [`prefill_dag`]
/// puts each stage of [`STAGES`] as its CPU node, then its NPU node.
fn cpu_node(s: usize) -> usize {
    2 * s
}

/// The DAG node of NPU stage `s` within a layer.
fn npu_node(s: usize) -> usize {
    2 * s + 1
}

/// `chunk_len` when it is a chunk length this model can take: 1 row up to its context.
pub(super) fn check_chunk_len(chunk_len: usize, context_len: usize) -> Result<usize> {
    if chunk_len == 0 || chunk_len > context_len {
        return Err(Error::Input(format!(
            "chunk length {chunk_len}: expected 1 to the model's context of {context_len} tokens (e.g. {})",
            256.min(context_len)
        )));
    }
    Ok(chunk_len)
}

/// The prefill DAG of `plan` for `n_layer` layers: per layer each NPU stage of [`STAGES`] with
/// the CPU stage before it, and a CPU tail per chunk (final rows out).
pub fn prefill_dag(plan: &ChunkPlan, n_layer: usize) -> Result<SubgraphDag> {
    let stages: Vec<StageDesc> =
        STAGES.iter().flat_map(|s| [StageDesc::new(s.cpu, Processor::Cpu, s.cpu_reads_kv), StageDesc::new(s.name, Processor::Npu, false)]).collect();
    debug_assert!((0..N_STAGES).all(|s| stages[cpu_node(s)].name == STAGES[s].cpu && stages[npu_node(s)].name == STAGES[s].name));
    let chunks: Vec<DagChunk> = plan.chunks.iter().map(|c| DagChunk { rows: c.padded_len, margin: c.margin }).collect();
    SubgraphDag::new(&stages, n_layer, Some(StageDesc::new("tail", Processor::Cpu, false)), &chunks)
}

impl Model {
    /// Report prefill progress (e.g. to a progress bar: an emulated NPU takes minutes).
    pub fn set_prefill_progress(&mut self, progress: Option<Progress>) {
        *self.progress.get_mut().unwrap_or_else(|e| e.into_inner()) = progress;
    }

    /// Rows of the NPU graphs a prompt is cut into ([`LoadOptions::chunk_len`]).
    pub fn chunk_len(&self) -> usize {
        self.chunk_len
    }

    /// Sets the chunk length of the next prefills: 1 row up to the model's context.
    pub fn set_chunk_len(&mut self, chunk_len: usize) -> Result<()> {
        self.chunk_len = check_chunk_len(chunk_len, self.cfg.context_len)?;
        Ok(())
    }

    /// Prepare the NPU stage graphs for the chunk length, and for the smaller sizes of
    /// [`SchedOptions::small_chunks`], now (otherwise the first prefill that uses them does).
    pub fn prepare(&mut self) -> Result<()> {
        self.prepare_chunked(self.chunk_len)
    }

    /// [`Model::prepare`] for chunks of `chunk_len` rows.
    pub fn prepare_chunked(&mut self, chunk_len: usize) -> Result<()> {
        check_chunk_len(chunk_len, self.cfg.context_len)?;
        self.check_profile(self.precision)?;
        match self.sched.plan {
            PrefillPlan::Stages => self.prepare_sets(&self.npu_sets(chunk_len), self.precision),
            // The graphs of a prompt's first chunk, of each size (later capacities on first use).
            PrefillPlan::Layers => self.npu_sets(chunk_len).into_iter().try_for_each(|set| match set {
                GraphSet::Npu(m) => self.layer_graphs_for(m, super::layer_graph::capacity(0, m), self.precision).map(|_| ()),
                _ => Ok(()),
            }),
        }
    }

    /// The NPU graph sets a prefill in chunks of `chunk_len` may use, prepared together (shared
    /// QNN contexts on the HTP): the chunk length and the smaller [`SchedOptions::small_chunks`].
    pub(super) fn npu_sets(&self, chunk_len: usize) -> Vec<GraphSet> {
        let small = self.sched.small_chunks.iter().copied().filter(|&s| s > 0 && s < chunk_len);
        std::iter::once(chunk_len).chain(small).map(GraphSet::Npu).collect()
    }

    pub(super) fn check_profile(&self, precision: Precision) -> Result<()> {
        if precision != Precision::F32 && self.profile.is_none() {
            return Err(Error::Input(format!("{precision:?} prefill needs a quant profile: calibrate or load one first")));
        }
        Ok(())
    }

    /// Prefill `tokens` on the model's own conversation from its start (the KV cache cleared
    /// first), and return the logits `opts` asks for ([`Model::prefill_sequence`]'s): a prompt.
    pub fn prefill(&mut self, tokens: &[u32], opts: &PrefillOptions) -> Result<Tensor> {
        self.clear();
        self.extend(tokens, opts)
    }

    /// Prefill `tokens` on the model's own conversation after the tokens its KV cache holds (a
    /// conversation's next turn, a prompt after a restored prefix, a speculative verifier's
    /// rows), and return the logits `opts` asks for. Only the new tokens are computed; they
    /// attend to everything before them. On an error the cache is left as it was.
    pub fn extend(&mut self, tokens: &[u32], opts: &PrefillOptions) -> Result<Tensor> {
        self.on_own(|m, s| m.prefill_sequence(s, tokens, opts))
    }

    /// Runs `tokens` into `seq` after the tokens it holds (a prompt, or a conversation's next
    /// turn) through the model's prefill plan, and returns the logits `opts` asks for: the last
    /// token's, `[vocab]`, or every token's, `[n, vocab]`. The model is shared: several
    /// conversations may prefill and decode on it at once, each on its own sequence (the NPU's
    /// graphs run one at a time). On an error `seq` is left as it was.
    pub fn prefill_sequence(&self, seq: &mut Sequence, tokens: &[u32], opts: &PrefillOptions) -> Result<Tensor> {
        let chunk_len = opts.chunk_len.unwrap_or(self.chunk_len);
        let all = opts.logits == Logits::All;
        let plan = match opts.rows {
            PrefillRows::Planned => self.plan_chunked(tokens.len(), chunk_len)?,
            PrefillRows::NpuOnly => self.npu_only_plan(tokens.len(), chunk_len)?,
            PrefillRows::Cpu => {
                let x = self.run_cpu(&mut [(seq, tokens)], None, false)?;
                return match all {
                    true => self.logits(&x),
                    false => Ok(self.logits(&x.narrow(0, tokens.len() - 1, 1)?)?.squeeze(0)?),
                };
            }
        };
        let logits = self.run_prefill(seq, tokens, &plan, self.precision, all)?;
        Ok(if all { logits } else { logits.squeeze(0)? })
    }

    /// The chunk plan of a prefill of `n` tokens ([`Model::plan_chunked`] at the chunk length).
    pub fn plan(&self, n: usize) -> Result<ChunkPlan> {
        self.plan_chunked(n, self.chunk_len)
    }

    /// The chunk plan of a prefill of `n` tokens with NPU graphs of `chunk_len` rows: as many
    /// full chunks as fit, then, where the cost model (`Model::estimate`, simulated under the
    /// current policy) predicts a shorter prefill, chunks of the [`SchedOptions::small_chunks`]
    /// sizes, and the rest as [`SchedOptions::tail`] says.
    pub fn plan_chunked(&self, n: usize, chunk_len: usize) -> Result<ChunkPlan> {
        check_chunk_len(chunk_len, self.cfg.context_len)?;
        if self.sched.plan == PrefillPlan::Layers {
            // Every row on the NPU: full chunks, then the rest in the smaller sizes, padded.
            let mut sizes: Vec<usize> = self.sched.small_chunks.iter().copied().filter(|&s| s > 0 && s < chunk_len).collect();
            sizes.push(chunk_len);
            sizes.sort_unstable_by(|a, b| b.cmp(a));
            sizes.dedup();
            return ChunkPlan::with_sizes(n, &sizes, self.cfg.context_len, Tail::Pad);
        }
        let (ctx, tail) = (self.cfg.context_len, self.sched.tail);
        let mut sizes = vec![chunk_len];
        let mut best = ChunkPlan::with_sizes(n, &sizes, ctx, tail)?;
        let mut small: Vec<usize> = self.sched.small_chunks.iter().copied().filter(|&s| s > 0 && s < chunk_len).collect();
        small.sort_unstable_by(|a, b| b.cmp(a));
        if small.is_empty() {
            return Ok(best);
        }
        // A planned order belongs to one DAG; rank the candidates by critical path instead.
        let policy = match &self.sched.policy {
            Policy::Planned(_) => Policy::CriticalPath,
            p => p.clone(),
        };
        let costs = self.estimate();
        let makespan = |plan: &ChunkPlan| -> Result<f64> { Ok(simulate(&prefill_dag(plan, self.layers.len())?, &costs, &policy)?.makespan) };
        let mut best_time = makespan(&best)?;
        for s in small {
            sizes.push(s);
            let candidate = ChunkPlan::with_sizes(n, &sizes, ctx, tail)?;
            if candidate != best {
                let t = makespan(&candidate)?;
                if t < best_time {
                    (best, best_time) = (candidate, t);
                }
            }
        }
        Ok(best)
    }

    /// Every row on the NPU graphs of one size (a padded last chunk): for measurements of the
    /// NPU's numerics (importance, outlier counts), which a CPU margin would leave out.
    pub(super) fn npu_only_plan(&self, n: usize, chunk_len: usize) -> Result<ChunkPlan> {
        ChunkPlan::new(n, chunk_len, self.cfg.context_len, Tail::Pad)
    }

    /// Runs `plan` over `tokens` from `seq`'s position (after the tokens its KV cache holds).
    pub(super) fn run_prefill(&self, seq: &mut Sequence, tokens: &[u32], plan: &ChunkPlan, precision: Precision, all_logits: bool) -> Result<Tensor> {
        self.check_sequence(seq, false)?;
        self.check_tokens(tokens)?;
        self.check_profile(precision)?;
        let base = seq.pos;
        if base + tokens.len() > self.cfg.context_len {
            return Err(Error::Input(format!("{} tokens after the {base} the KV cache holds exceed the context of {}", tokens.len(), self.cfg.context_len)));
        }
        let r = match self.sched.plan {
            PrefillPlan::Stages => self.run_plan(seq, tokens, plan, precision, all_logits),
            PrefillPlan::Layers => self.run_layers(seq, tokens, plan, precision, all_logits),
        };
        if r.is_err() {
            // What a failed prefill appended goes: the cache holds the first `base` tokens again.
            seq.truncate(base);
        }
        r
    }

    pub(super) fn run_plan(&self, seq: &mut Sequence, tokens: &[u32], plan: &ChunkPlan, precision: Precision, all_logits: bool) -> Result<Tensor> {
        // Every size the plan could have used, at once: one unit of compiled graphs per chunk
        // length, whatever this prompt's length.
        let mut sets = self.npu_sets(plan.chunk_len);
        sets.extend(plan.npu_sizes().into_iter().map(GraphSet::Npu));
        self.prepare_sets(&sets, precision)?;
        let mut graphs = HashMap::new();
        for size in plan.npu_sizes() {
            graphs.insert(size, self.graphs_for(GraphSet::Npu(size), precision)?);
        }
        let margin = self.margin_graphs(plan, precision)?;
        let dag = prefill_dag(plan, self.layers.len())?;
        let npu_pool = self.npu_pool()?;
        let runner = Runner::new(&dag, &self.estimate(), self.sched.policy.clone())?;
        let total = plan.chunks.len() * self.layers.len();
        let done = std::sync::atomic::AtomicUsize::new(0);
        let (model, at) = (self, &*seq);
        let run = |chunk: &Chunk| {
            let on_layer = || {
                let d = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if let Some(report) = model.progress.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                    report(d, total);
                }
            };
            let graphs = match chunk.margin {
                true => margin.as_deref(),
                false => graphs.get(&chunk.padded_len).map(|g| &**g),
            };
            let r = model.run_chunk(at, chunk, tokens, precision, all_logits, &runner, &dag, graphs, npu_pool.as_deref(), on_layer);
            if r.is_err() {
                runner.abort();
            }
            r
        };
        // In order, the chunks run one after another on one thread. Otherwise a few workers
        // take the chunks in order, each walking one chunk's stages, and the runner decides
        // which of them holds the NPU and which the CPU. The lowest unfinished chunk depends on
        // no unfinished one, so any number of workers makes progress (see
        // `SchedOptions::chunks_in_flight` for how many).
        // A lone chunk worker walks its stages on a thread of the rayon pool that runs their
        // GEMMs and row kernels: each parallel step is then a `join` inside the pool. From any
        // other thread every step is a job injected into the pool and waited for on a futex,
        // which put the pool's threads to sleep and woke them some 500 times per 256-token
        // chunk (measured: 6-14% of a SmolLM2 prefill on 2 cores). Several chunk workers stay
        // plain threads: they block on the runner's grants, which would idle a pool thread.
        // The host executor without an NPU queue of its own (`npu_threads: None`) runs the "NPU"
        // stages on the same pool as the CPU stages: no second processor has bubbles for another
        // chunk to fill, and one worker on the pool measured 4-6% faster than FIFO's four at
        // 1024 tokens (SmolLM2, 2 cores): the chunks run in order whatever the policy.
        let in_order = self.chunks_in_order();
        let workers = if in_order { 1 } else { plan.chunks.len().min(self.sched.chunks_in_flight) };
        if self.policy_set_aside(plan.chunks.len()) {
            tracing::debug!(policy = self.sched.policy.name(), "host executor sharing the CPU stages' pool: chunks run in order");
        }
        let results: Vec<ChunkOutput> = if workers <= 1 {
            rayon::scope(|_| plan.chunks.iter().map(run).collect())
        } else {
            let next = std::sync::atomic::AtomicUsize::new(0);
            let slots: Vec<Mutex<Option<ChunkOutput>>> = plan.chunks.iter().map(|_| Mutex::new(None)).collect();
            let work = || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(chunk) = plan.chunks.get(i) else { break };
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(chunk))).unwrap_or_else(|_| {
                    runner.abort();
                    Err(Error::Internal(format!("prefill chunk {i} panicked")))
                });
                *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            };
            // This thread is one of the workers.
            std::thread::scope(|s| {
                for _ in 1..workers {
                    s.spawn(work);
                }
                work();
            });
            slots
                .into_iter()
                .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()).unwrap_or_else(|| Err(Error::Internal("a prefill chunk never ran".into()))))
                .collect()
        };
        let mut out_rows = Vec::with_capacity(results.len());
        let mut errors = vec![];
        for r in results {
            match r {
                Ok((rows, shadow)) => {
                    *self.shadow_time.lock().unwrap_or_else(|e| e.into_inner()) += shadow;
                    out_rows.push(rows);
                }
                Err(e) => errors.push(e),
            }
        }
        // The cause, not the chunks the runner stopped because of it.
        if let Some(i) = errors.iter().position(|e| !matches!(e, Error::Aborted { .. })).or((!errors.is_empty()).then_some(0)) {
            return Err(errors.swap_remove(i));
        }
        let schedule = runner.schedule();
        drop(runner);
        seq.last_run = Some(Arc::new((dag, schedule)));
        seq.pos += tokens.len();
        let rows: Vec<Tensor> = out_rows.into_iter().filter(|r| r.dim(0).is_ok_and(|n| n > 0)).collect();
        self.logits(&Tensor::cat(&rows, 0)?)
    }

    /// One chunk of a prefill, stage by stage, each under its processor's grant from `runner`.
    /// Returns the chunk's rows for the logits (all valid rows, or the last one of the last
    /// chunk, or none) and its shadow-path CPU time.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_chunk(
        &self,
        seq: &Sequence,
        chunk: &Chunk,
        tokens: &[u32],
        precision: Precision,
        all_logits: bool,
        runner: &Runner,
        dag: &SubgraphDag,
        graphs: Option<&Vec<Vec<PreparedGraph>>>,
        npu_pool: Option<&rayon::ThreadPool>,
        mut on_layer: impl FnMut(),
    ) -> ChunkOutput {
        let n_layer = self.layers.len();
        let node = |l: usize, s: usize| {
            dag.node_at(chunk.index, l, s).ok_or_else(|| Error::Internal(format!("sched: no node for chunk {} layer {l} stage {s}", chunk.index)))
        };
        let (m, n_valid) = (chunk.padded_len, chunk.len);
        let mut cpu = Some(runner.acquire(node(0, cpu_node(0))?)?);
        let mut ids = tokens[chunk.start..chunk.start + n_valid].to_vec();
        ids.resize(m, 0);
        let mut x = Residual::new(self.embed_rows(&ids)?);
        // Positions after the tokens the cache held before this prefill (`seq.pos`, updated
        // when the prefill is done). The cache is sized once for the prompt and the first
        // `KvCache::GROW` decoded tokens: growing it at the first decode step copied every layer
        // into a new buffer while the old one was still held (SmolLM2 after a 700-token prompt:
        // +58 MiB resident at the first token, 431 MiB peak; 11 MiB of headroom instead).
        let reserve = (seq.pos + tokens.len() + KvCache::GROW).min(self.cfg.context_len);
        let rows = Rows::new(&self.spec, seq.pos + chunk.start, m, n_valid, reserve)?;
        let mut shadow_time = Duration::ZERO;
        for l in 0..n_layer {
            let layer = &self.layers[l];
            let mut stage = Stage {
                layer,
                l,
                points: self.points.get(l),
                shadow: self.shadow_on.get(l).copied().unwrap_or(false),
                a16: self.a16.get(l),
                shadow_time: Duration::ZERO,
                rows: &rows,
                precision,
            };
            let mut run = |s: usize, h: &Tensor| -> Result<Vec<Tensor>> {
                // The CPU node after this stage: the next stage's input, or the next layer's.
                let next = if s + 1 < N_STAGES { node(l, cpu_node(s + 1))? } else { node(l + 1, cpu_node(0))? };
                let ys = match graphs {
                    Some(graphs) => {
                        let (input, outliers) = stage.prepare(s, h)?;
                        cpu = None;
                        let outs = {
                            // The NPU's grant, or the CPU's for a margin's host graphs.
                            let _grant = runner.acquire(node(l, npu_node(s))?)?;
                            let exec = || match chunk.margin {
                                true => graphs[l][s].execute_rows(&[&input], m),
                                false => graphs[l][s].execute(&[&input]),
                            };
                            match npu_pool.filter(|_| !chunk.margin) {
                                Some(pool) => pool.install(exec)?,
                                None => exec()?,
                            }
                        };
                        cpu = Some(runner.acquire(next)?);
                        stage.finish(s, outs, &outliers)?
                    }
                    // A margin without host graphs: the stage's linears on the decode weights.
                    // (Each grant is released before the next is asked for: both are the CPU's.)
                    _ => {
                        cpu = None;
                        let linears = runner.acquire(node(l, npu_node(s))?)?;
                        let ys = layer.stages[s].iter().map(|lin| lin.forward(h)).collect::<Result<Vec<_>>>()?;
                        drop(linears);
                        cpu = Some(runner.acquire(next)?);
                        ys
                    }
                };
                Ok(ys)
            };
            let attn = [Attn { at: 0, rows: &rows, kv: &seq.kv[l] }];
            layer.forward(&self.cfg, &self.spec, l, &mut x, &attn, &mut run)?;
            shadow_time += stage.shadow_time;
            on_layer();
        }
        let x = x.finish()?;
        let last = chunk.start + chunk.len == tokens.len();
        let out = if all_logits {
            x.narrow(0, 0, n_valid)?
        } else if last {
            x.narrow(0, n_valid - 1, 1)?
        } else {
            x.narrow(0, 0, 0)?
        };
        drop(cpu);
        Ok((out, shadow_time))
    }

    /// The layer's shapes, for analytic stage costs ([`AnalyticCosts`]).
    pub fn layer_shape(&self) -> LayerShape {
        let c = &self.cfg;
        LayerShape { hidden: c.hidden, ffn: c.ffn, n_head: c.n_head, n_kv_head: c.n_kv_head, head_dim: c.head_dim }
    }

    /// Stage costs for the policies that rank by cost: analytic, with the host's rough rates
    /// (only their ratios matter to a ranking).
    pub(super) fn estimate(&self) -> AnalyticCosts {
        AnalyticCosts { shape: self.layer_shape(), rates: Rates::HOST }
    }

    pub(super) fn npu_pool(&self) -> Result<Option<Arc<rayon::ThreadPool>>> {
        let Some(threads) = self.sched.npu_threads else {
            return Ok(None);
        };
        let mut npu_pool = self.npu_pool.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((t, pool)) = &*npu_pool {
            if *t == threads {
                return Ok(Some(pool.clone()));
            }
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("npu-queue-{i}"))
            .build()
            .map_err(|e| Error::Input(format!("cannot start the NPU queue's {threads} threads: {e}")))?;
        let pool = Arc::new(pool);
        *npu_pool = Some((threads, pool.clone()));
        Ok(Some(pool))
    }

    /// Whether a prefill's chunks run one after another whatever the policy: in order, or with
    /// the host executor as the NPU and no NPU queue of its own (`npu_threads: None`), whose
    /// "NPU" and CPU stages share the cores (see `run_prefill`).
    pub fn chunks_in_order(&self) -> bool {
        self.sched.policy == Policy::InOrder || (self.sched.npu_threads.is_none() && self.device.on_host())
    }

    /// Whether a prefill of `chunks` chunks runs them in order although the policy would not
    /// ([`Self::chunks_in_order`] for another reason than the policy; one chunk has no order).
    pub fn policy_set_aside(&self, chunks: usize) -> bool {
        self.chunks_in_order() && self.sched.policy != Policy::InOrder && chunks > 1
    }

    /// Schedules the next prefills with `sched` instead of [`LoadOptions::sched`] (for
    /// comparisons of schedules on one loaded model); checked as at load.
    pub fn set_sched(&mut self, sched: SchedOptions) -> Result<()> {
        sched.validate(self.cfg.context_len)?;
        sched.check_precision(self.precision)?;
        if sched.plan != self.sched.plan {
            self.shadow_columns(sched.plan)?;
        }
        self.sched = sched;
        Ok(())
    }

    /// How prefills are scheduled.
    pub fn sched(&self) -> &SchedOptions {
        &self.sched
    }

    /// The model's own conversation's last prefill's DAG and schedule (what ran where and when):
    /// for traces and bubble rates ([`Sequence::last_run`] of another conversation's).
    pub fn last_run(&self) -> Option<Arc<(SubgraphDag, Schedule)>> {
        self.seq.last_run()
    }

    /// The graphs a CPU margin runs its linears on, on any row count
    /// ([`PreparedGraph::execute_rows`]): the NPU's own stage graphs when the NPU is the host
    /// executor (no other weights, ~4x the speed of candle's Q8_0 matmul at 24-100 rows:
    /// measured 32-40 vs 9-10 GMAC/s on 2 cores); beside a real NPU, whose graphs have static
    /// shapes, the same stage graphs on a host executor with the NPU's numerics
    /// ([`NpuDevice::margin_device`]). Either way margin rows get the NPU rows' W8A8 + shadow
    /// arithmetic: exactly with the host executor, as far as the numerics model matches the
    /// library beside a real NPU (99.6% of stage outputs bit-exact), which is not far enough to
    /// keep near ties, so a real NPU pads by default ([`SchedOptions::for_device`]). `None` for
    /// a float prefill beside a real NPU: its margin runs the decode weights.
    pub(super) fn margin_graphs(&self, plan: &ChunkPlan, precision: Precision) -> Result<Option<Arc<Vec<Vec<PreparedGraph>>>>> {
        // A float prefill beside a real NPU: no host copy of the float weights to run them on.
        if !plan.chunks.iter().any(|c| c.margin) || (precision == Precision::F32 && !self.device.on_host()) {
            return Ok(None);
        }
        let set = if self.device.on_host() { GraphSet::Npu(plan.chunk_len) } else { GraphSet::Margin };
        let graphs = self.graphs_for(set, precision)?;
        if let Some(g) = graphs.iter().flatten().find(|g| !g.any_rows()) {
            tracing::warn!(graph = g.name(), "a stage graph cannot run on any row count: margin rows run on the decode weights (not the NPU's arithmetic)");
            return Ok(None);
        }
        Ok(Some(graphs))
    }

    pub(super) fn graphs_for(&self, set: GraphSet, precision: Precision) -> Result<Arc<Vec<Vec<PreparedGraph>>>> {
        self.prepare_sets(&[set], precision)?;
        Ok(self.graphs.lock().unwrap_or_else(|e| e.into_inner())[&(set, precision)].clone())
    }

    /// Prepares the stage graphs of every layer for the sets in `sets` not prepared yet, the NPU's
    /// in one [`NpuDevice::prepare_described`]: on the HTP, in shared QNN contexts (one per model
    /// with weight sharing, whose sizes hold their weights once; one per size without: see
    /// `candle_npu::Contexts`), each one cache entry and one load. Margin graphs (any row count)
    /// run on the margin's device, described with one row.
    /// The map stays locked while they are prepared: another conversation needing graphs waits
    /// for these (the same ones, likely) rather than preparing them twice.
    pub(super) fn prepare_sets(&self, sets: &[GraphSet], precision: Precision) -> Result<()> {
        let mut map = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let mut todo: Vec<GraphSet> = Vec::new();
        for &set in sets {
            if !map.contains_key(&(set, precision)) && !todo.contains(&set) {
                todo.push(set);
            }
        }
        for margin in [false, true] {
            let group: Vec<GraphSet> = todo.iter().copied().filter(|s| (*s == GraphSet::Margin) == margin).collect();
            if group.is_empty() {
                continue;
            }
            let device = if margin { self.device.margin_device() } else { self.device.clone() };
            let t = std::time::Instant::now();
            let rows: Vec<usize> = group.iter().map(|set| if let GraphSet::Npu(m) = set { *m } else { 1 }).collect();
            let per_set = self.cfg.n_layer * N_STAGES;
            // Described on demand: a description holds a copy of its weights.
            let describe = |i: usize| self.stage_graph(i % per_set / N_STAGES, i % N_STAGES, rows[i / per_set], precision);
            let mut prepared = device.prepare_described(group.len() * per_set, describe)?.into_iter();
            for set in &group {
                let graphs: Vec<Vec<PreparedGraph>> = (0..self.cfg.n_layer).map(|_| prepared.by_ref().take(N_STAGES).collect()).collect();
                // Host graphs hand their packed weights to the shadow path (cold columns).
                for (layer, stages) in self.layers.iter().zip(&graphs) {
                    for (lins, graph) in layer.stages.iter().zip(stages) {
                        lins.iter().for_each(|lin| lin.attach_packed(graph));
                    }
                }
                map.insert((*set, precision), Arc::new(graphs));
            }
            tracing::info!(
                sets = ?group,
                ?precision,
                graphs = group.len() * per_set,
                secs = t.elapsed().as_secs_f32(),
                executor = device.executor_name(),
                "prepared stage graphs"
            );
        }
        Ok(())
    }

    /// Describe the static NPU graphs of one layer for chunks of `m` rows: per stage, one input
    /// (F32, or u8 over the point's clip range) and one F32 output per linear.
    pub fn layer_graphs(&self, l: usize, m: usize, precision: Precision) -> Result<Vec<Graph>> {
        (0..N_STAGES).map(|s| self.stage_graph(l, s, m, precision)).collect()
    }

    /// The static NPU graph of stage `s` ([`STAGES`]) of layer `l` for chunks of `m` rows (see
    /// [`Self::layer_graphs`]).
    pub fn stage_graph(&self, l: usize, s: usize, m: usize, precision: Precision) -> Result<Graph> {
        self.check_profile(precision)?;
        let lins = &self.layers[l].stages[s];
        let k = lins[0].dims().1;
        let mut g = Graph::new(format!("blk.{l}.{}.m{m}", STAGES[s].name));
        let x: TensorId = match precision {
            Precision::F32 => g.input("x", &[m, k], DType::F32, None),
            Precision::W8A8 => g.input("x", &[m, k], DType::U8, Some(self.points[l][s].quant)),
            Precision::W8A16 => g.input("x", &[m, k], DType::U16, Some(self.a16[l][s])),
            Precision::W8A16Shadow => g.input("x", &[m, k], DType::U16, Some(self.points[l][s].quant_u16())),
        };
        for lin in lins {
            let y = lin.add_to_graph(&mut g, "", x)?;
            g.mark_output(y);
        }
        Ok(g)
    }
}

/// The NPU stages of one layer of one chunk: each input goes to the NPU (quantized, outliers
/// extracted), each output comes back with its shadow added.
struct Stage<'a> {
    layer: &'a Layer,
    l: usize,
    /// W8A8 input points and whether the shadow path runs (set with a profile).
    points: Option<&'a [InputPoint; N_STAGES]>,
    shadow: bool,
    a16: Option<&'a [Quant; N_STAGES]>,
    /// CPU time of the shadow path in this layer.
    shadow_time: Duration,
    rows: &'a Rows,
    precision: Precision,
}

impl Stage<'_> {
    /// The NPU input of stage `s` from the CPU activation `h` (`[m, K]`), and its outliers.
    fn prepare(&mut self, s: usize, h: &Tensor) -> Result<(TensorData, Outliers)> {
        let missing = || Error::Input(format!("{:?} prefill of layer {} without a quant profile", self.precision, self.l));
        Ok(match self.precision {
            Precision::F32 => (TensorData::F32(h.flatten_all()?.to_vec1::<f32>()?), Outliers::default()),
            Precision::W8A8 | Precision::W8A16Shadow => {
                let point = &self.points.ok_or_else(missing)?[s];
                // The quantized input and the outliers straight from the activation's storage.
                let (shadow, n_valid, u8_grid) = (self.shadow, self.rows.n_valid, self.precision == Precision::W8A8);
                let (x, o, secs) = with_f32(h, |vals| {
                    let t = Instant::now();
                    // A pruned stage skips extraction (its outliers would go unused).
                    let o = if shadow { point.extract(vals, n_valid) } else { Outliers::default() };
                    let secs = t.elapsed();
                    let x = match u8_grid {
                        true => TensorData::U8(point.clip_quantize(vals)),
                        false => point.clip_quantize_u16(vals),
                    };
                    (x, o, secs)
                })?;
                self.shadow_time += secs;
                (x, o)
            }
            Precision::W8A16 => {
                let q = self.a16.ok_or_else(missing)?[s];
                (with_f32(h, |vals| TensorData::from_f32(vals, DType::U16, Some(q)))?, Outliers::default())
            }
        })
    }

    /// Stage `s`'s NPU outputs as `[m, N]` tensors, one per linear, with bias and shadow added.
    fn finish(&mut self, s: usize, outs: Vec<TensorData>, outliers: &Outliers) -> Result<Vec<Tensor>> {
        let t = Instant::now();
        let ys = self.layer.stages[s]
            .iter()
            .zip(outs)
            .map(|(lin, out)| {
                let TensorData::F32(mut y) = out else {
                    return Err(Error::Internal(format!("NPU stage of {} returned {:?}, expected F32", lin.name(), out.dtype())));
                };
                lin.finish(outliers, &mut y)?;
                Ok(Tensor::from_vec(y, (self.rows.m, lin.dims().0), &Device::Cpu)?)
            })
            .collect();
        if !outliers.is_empty() {
            self.shadow_time += t.elapsed();
        }
        ys
    }
}
