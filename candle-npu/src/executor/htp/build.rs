//! Translating IR graphs into QNN graphs in a context, and finalizing them.

use super::*;

pub(super) fn qnn_dtype(d: DType) -> Qnn_DataType_t {
    match d {
        DType::F32 => QNN_DATATYPE_FLOAT_32,
        DType::U8 => QNN_DATATYPE_UFIXED_POINT_8,
        DType::U16 => QNN_DATATYPE_UFIXED_POINT_16,
        DType::I8 => QNN_DATATYPE_SFIXED_POINT_8,
        DType::I32 => QNN_DATATYPE_SFIXED_POINT_32,
    }
}

/// Letters, digits and `_` only: QNN names end up in context binaries and log lines.
/// The name tensor `id` (called `name` in the IR) is created with in a QNN graph: unique within
/// the graph, and what a context binary's metadata gives back.
pub(super) fn qnn_tensor_name(id: TensorId, name: &str) -> String {
    format!("t{}_{}", id.0, sanitize(name))
}

pub(super) fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect()
}

/// What a context needs of a graph besides its weights: its index for `describe`, its name,
/// its fingerprint (for the cache key), its buffers (the tensor ids are set when it is built
/// or retrieved) and whether its build is checked ([`check`]).
pub(super) struct Described {
    pub(super) index: usize,
    pub(super) name: String,
    pub(super) fingerprint: [u8; 32],
    pub(super) inputs: Vec<IoTensor>,
    pub(super) outputs: Vec<IoTensor>,
    pub(super) checked: bool,
}

impl Described {
    pub(super) fn of(graph: &Graph, index: usize) -> Self {
        Described {
            index,
            name: graph.name.clone(),
            fingerprint: graph.fingerprint(),
            inputs: io_tensors(graph, &graph.inputs),
            outputs: io_tensors(graph, &graph.outputs),
            checked: check::needs_check(graph),
        }
    }
}

/// The buffers `ids` of `graph`, without QNN tensor ids yet.
pub(super) fn io_tensors(graph: &Graph, ids: &[TensorId]) -> Vec<IoTensor> {
    ids.iter()
        .map(|&id| {
            let s = graph.tensor(id);
            IoTensor { qnn_id: None, name: s.name.clone(), qnn_name: qnn_tensor_name(id, &s.name), dtype: s.dtype, shape: s.shape.clone(), len: s.elem_count() }
        })
        .collect()
}

/// A failure while adding nodes: QNN error code (0 when not from QNN) and message.
pub(super) type NodeError = (u64, String);

/// Builds one QNN graph; owns every name and dims array a created tensor points at until
/// finalize.
pub(super) struct Builder<'a> {
    pub(super) rt: &'a Runtime,
    pub(super) graph: &'a Graph,
    pub(super) handle: Qnn_GraphHandle_t,
    pub(super) names: Vec<CString>,
    pub(super) dims: Vec<Box<[u32]>>,
    /// Per-channel scale/offset arrays of AXIS_SCALE_OFFSET tensors.
    pub(super) axis_scales: Vec<Box<[Qnn_ScaleOffset_t]>>,
    /// Constants the lowering adds (per-channel scale vectors, FP16 norm weights, axis lists),
    /// each a boxed slice whose heap data does not move.
    pub(super) lowered: Vec<Box<dyn std::any::Any>>,
    /// Created tensors, by IR tensor index.
    pub(super) tensors: Vec<Option<Qnn_Tensor_t>>,
    /// Per-channel weights lowered to one scale (see `op`), by IR tensor index: created once
    /// however many FullyConnected ops read the weight (a shadow W8A16 input's two parts).
    pub(super) per_tensor_weights: Vec<Option<Qnn_Tensor_t>>,
    pub(super) n_native: usize,
}

impl Builder<'_> {
    pub(super) fn cstr(&mut self, s: String) -> *const c_char {
        let c = CString::new(s).expect("sanitized names have no NUL");
        let p = c.as_ptr();
        self.names.push(c);
        p
    }

    pub(super) fn create(
        &mut self,
        name: String,
        ty: Qnn_TensorType_t,
        dt: Qnn_DataType_t,
        q: Qnn_QuantizeParams_t,
        shape: &[usize],
        buf: Qnn_ClientBuffer_t,
    ) -> std::result::Result<Qnn_Tensor_t, NodeError> {
        let name_ptr = self.cstr(name.clone());
        let mut dims: Box<[u32]> = shape.iter().map(|&d| d as u32).collect();
        let dims_ptr = dims.as_mut_ptr();
        self.dims.push(dims);
        let mut t = Qnn_Tensor_t::v1(name_ptr, ty, dt, q, shape.len() as u32, dims_ptr, buf);
        let create = self.rt.f().tensorCreateGraphTensor.ok_or((0, "library lacks tensorCreateGraphTensor".to_string()))?;
        let mark = log_mark();
        // SAFETY: `t` and everything it points at (name, dims, static data) are alive.
        let rc = unsafe { create(self.handle, &mut t) };
        if rc != QNN_SUCCESS {
            let msg = format!("tensorCreateGraphTensor '{name}': {}", self.rt.message(rc));
            return Err((error_code(rc) as u64, with_log(msg, &log_errors_since(mark))));
        }
        Ok(t)
    }

    /// The QNN tensor of IR tensor `id`, created on first use.
    pub(super) fn ir(&mut self, id: TensorId) -> std::result::Result<Qnn_Tensor_t, NodeError> {
        if let Some(t) = self.tensors[id.0] {
            return Ok(t);
        }
        let g = self.graph;
        let spec = g.tensor(id);
        let ty = if g.inputs.contains(&id) {
            QNN_TENSOR_TYPE_APP_WRITE
        } else if g.outputs.contains(&id) {
            QNN_TENSOR_TYPE_APP_READ
        } else {
            match spec.kind {
                TensorKind::Input => QNN_TENSOR_TYPE_APP_WRITE,
                TensorKind::Output => QNN_TENSOR_TYPE_APP_READ,
                TensorKind::Intermediate => QNN_TENSOR_TYPE_NATIVE,
                TensorKind::Static => QNN_TENSOR_TYPE_STATIC,
            }
        };
        let q = match (&spec.channel_scales, spec.quant) {
            // Per-channel weights `[N, K]`: one symmetric scale per output channel, axis 0; LPBQ
            // adds a 4-bit scale per block of K (BLOCKWISE_EXPANSION).
            (Some(scales), _) => {
                let mut so: Box<[Qnn_ScaleOffset_t]> = scales.iter().map(|&scale| Qnn_ScaleOffset_t { scale, offset: 0 }).collect();
                let q = match &spec.block_scales {
                    None => Qnn_QuantizeParams_t::axis_scale_offset(0, &mut so),
                    Some(b) => {
                        // The x86 library reads both arrays as if the weight had `max(N, K)`
                        // channels (caught 2026-12-03 with each array ending at an unmapped page:
                        // its tensorCreateGraphTensor read scaleOffsets[N..K] and then K x blocks
                        // block scales, [N, K] = [256, 576]), though its products use the first N.
                        // What lay beyond our arrays was the heap: now and then it made the
                        // prepare wrong, crashed it, or grew it to 22 GB (`check`). The arrays
                        // are padded to `max(N, K)` channels, the real ones repeated.
                        let (n, blocks) = (spec.shape[0], spec.shape[1] / b.block);
                        let channels = n.max(spec.shape[1]);
                        so = (0..channels).map(|c| so[c % n]).collect();
                        let mut block_scales: Box<[u8]> = (0..channels * blocks).map(|i| b.scales[i % b.scales.len()]).collect();
                        let mut be = Box::new(Qnn_BlockwiseExpansion_t {
                            axis: 0,
                            scaleOffsets: so.as_mut_ptr(),
                            numBlocksPerAxis: blocks as u32,
                            blockScaleBitwidth: 4,
                            blockScaleStorageType: QNN_BLOCKWISE_EXPANSION_BITWIDTH_SCALE_STORAGE_8,
                            blocksScale: block_scales.as_mut_ptr().cast(),
                        });
                        let q = Qnn_QuantizeParams_t::blockwise_expansion(&mut be);
                        self.lowered.push(Box::new(block_scales));
                        self.lowered.push(be);
                        q
                    }
                };
                // Boxes keep their heap data in place when moved: the pointers stay valid until
                // the graph is finalized.
                self.axis_scales.push(so);
                q
            }
            (None, Some(q)) if spec.dtype.is_quantized() => Qnn_QuantizeParams_t::scale_offset(q.scale, q.offset),
            _ => Qnn_QuantizeParams_t::undefined(),
        };
        // QNN only reads static data, and has copied it by the end of graphFinalize (checked:
        // overwriting the weights after finalize does not change outputs); `self.graph` is
        // borrowed until then.
        let buf = match &spec.data {
            Some(StaticData::F32(v)) => Qnn_ClientBuffer_t { data: v.as_ptr() as *mut c_void, dataSize: (v.len() * 4) as u32 },
            // LPBQ weights are given as their 4-bit values (8-bit containers): each INT8 value
            // over its block scale (exact: validated).
            Some(StaticData::I8(v)) if spec.block_scales.is_some() => {
                let (b, k) = (spec.block_scales.as_ref().expect("matched"), spec.shape[1]);
                let values: Box<[i8]> = v.iter().enumerate().map(|(i, &q)| q / b.of(i, k) as i8).collect();
                let buf = Qnn_ClientBuffer_t { data: values.as_ptr() as *mut c_void, dataSize: values.len() as u32 };
                self.lowered.push(Box::new(values));
                buf
            }
            Some(StaticData::I8(v)) => Qnn_ClientBuffer_t { data: v.as_ptr() as *mut c_void, dataSize: v.len() as u32 },
            Some(StaticData::I32(v)) => Qnn_ClientBuffer_t { data: v.as_ptr() as *mut c_void, dataSize: (v.len() * 4) as u32 },
            None => Qnn_ClientBuffer_t::empty(),
        };
        let t = self.create(qnn_tensor_name(id, &spec.name), ty, qnn_dtype(spec.dtype), q, &spec.shape, buf)?;
        self.tensors[id.0] = Some(t);
        Ok(t)
    }

    /// A STATIC tensor the lowering adds, holding `data` (kept until finalize).
    pub(super) fn lowered_constant<T: Copy + 'static>(
        &mut self,
        name: String,
        dt: Qnn_DataType_t,
        shape: &[usize],
        data: Box<[T]>,
    ) -> std::result::Result<Qnn_Tensor_t, NodeError> {
        let buf = Qnn_ClientBuffer_t { data: data.as_ptr() as *mut c_void, dataSize: std::mem::size_of_val(&*data) as u32 };
        self.lowered.push(Box::new(data)); // moves the box, not its heap data: the pointer stays valid
        self.create(name, QNN_TENSOR_TYPE_STATIC, dt, Qnn_QuantizeParams_t::undefined(), shape, buf)
    }

    /// A NATIVE tensor the lowering adds.
    pub(super) fn native(&mut self, base: &str, dt: Qnn_DataType_t, q: Qnn_QuantizeParams_t, shape: &[usize]) -> std::result::Result<Qnn_Tensor_t, NodeError> {
        self.n_native += 1;
        let name = format!("x{}_{}", self.n_native, base);
        self.create(name, QNN_TENSOR_TYPE_NATIVE, dt, q, shape, Qnn_ClientBuffer_t::empty())
    }

    /// Adds one node. `name` must start with `op{index}_` (see [`culprit`]).
    pub(super) fn node(
        &mut self,
        name: String,
        type_name: &CStr,
        params: &mut [Qnn_Param_t],
        inputs: &mut [Qnn_Tensor_t],
        outputs: &mut [Qnn_Tensor_t],
    ) -> std::result::Result<(), NodeError> {
        let name_ptr = self.cstr(name);
        let op = Qnn_OpConfig_t::v1(name_ptr, QNN_OP_PACKAGE_NAME_QTI_AISW.as_ptr(), type_name.as_ptr(), params, inputs, outputs);
        let add = self.rt.f().graphAddNode.ok_or((0, "library lacks graphAddNode".to_string()))?;
        let mark = log_mark();
        // SAFETY: every pointer in `op` (names, params, tensors and what they point at) is alive.
        let rc = unsafe { add(self.handle, op) };
        if rc != QNN_SUCCESS {
            let msg = format!("graphAddNode: {}", self.rt.message(rc));
            return Err((error_code(rc) as u64, with_log(msg, &log_errors_since(mark))));
        }
        Ok(())
    }
}

/// The IR op whose node QNN's log names (`"op{index}_..."`), if any. Best effort: the log ring
/// is process-wide, so a concurrent failing prepare could contribute lines.
pub(super) fn culprit<'g>(graph: &'g Graph, log: &[String]) -> Option<&'g Op> {
    log.iter().rev().find_map(|line| {
        line.match_indices("\"op").find_map(|(at, _)| {
            let digits: String = line[at + 3..].chars().take_while(|c| c.is_ascii_digit()).collect();
            let i: usize = digits.parse().ok()?;
            line[at + 3 + digits.len()..].starts_with('_').then(|| graph.ops.get(i)).flatten()
        })
    })
}

/// Translates and finalizes `graphs` in a new context (with the HTP's weight sharing if asked),
/// one after another, each described just before: QNN copies a graph's weights by its
/// graphFinalize, so one description is alive at a time.
pub(super) fn build_all(
    rt: &Arc<Runtime>,
    graphs: &[&Described],
    describe: &dyn Fn(usize) -> Result<Graph>,
    weight_sharing: bool,
    profiles: Option<Profiles>,
) -> Result<Vec<HtpGraph>> {
    check_unique_names(graphs)?;
    let ctx = Context::create(rt, graphs.len(), weight_sharing).map_err(|(code, message)| Error::Prepare {
        graph: set_name(graphs),
        op: "-".into(),
        shapes: "contextCreate".into(),
        code,
        message,
    })?;
    let ctx = Arc::new(ctx);
    graphs
        .iter()
        .map(|d| {
            let graph = describe(d.index)?;
            if graph.name != d.name {
                return Err(Error::Internal(format!("graph {} described as '{}' the second time", d.name, graph.name)));
            }
            add_graph(&ctx, &graph, profiles.clone())
        })
        .collect()
}

/// The name of a set of graphs in logs and cache file names: its first graph's, and how many
/// others.
pub(super) fn set_name(graphs: &[&Described]) -> String {
    match graphs {
        [] => "no graphs".into(),
        [g] => g.name.clone(),
        [g, rest @ ..] => format!("{}+{}", g.name, rest.len()),
    }
}

/// Graphs of one context are told apart by their QNN names (graphRetrieve; two equal ones in a
/// context are QNN error 6003): [`sanitize`] must keep them apart.
pub(super) fn check_unique_names(graphs: &[&Described]) -> Result<()> {
    let mut seen = std::collections::HashMap::new();
    for g in graphs {
        if let Some(other) = seen.insert(sanitize(&g.name), &g.name) {
            return Err(Error::Prepare {
                graph: g.name.clone(),
                op: "-".into(),
                shapes: "context".into(),
                code: 0,
                message: format!("graphs '{other}' and '{}' have one QNN name, '{}': they cannot share a context", g.name, sanitize(&g.name)),
            });
        }
    }
    Ok(())
}

/// Translates and finalizes `graph` in `ctx`.
pub(super) fn add_graph(ctx: &Arc<Context>, graph: &Graph, profiles: Option<Profiles>) -> Result<HtpGraph> {
    let rt = &ctx.rt;
    let mut inputs = io_tensors(graph, &graph.inputs);
    let mut outputs = io_tensors(graph, &graph.outputs);

    let f = *rt.f();
    let err = |op: &str, shapes: String, code: u64, message: String| Error::Prepare { graph: graph.name.clone(), op: op.to_string(), shapes, code, message };
    let (Some(graph_create), Some(finalize)) = (f.graphCreate, f.graphFinalize) else {
        return Err(err("-", String::new(), 0, "library lacks graphCreate/graphFinalize".into()));
    };

    // HTP graph custom configs.
    let mut customs: Vec<QnnHtpGraph_CustomConfig_t> = Vec::new();
    if let Some(level) = rt.config.optimization_level {
        customs.push(QnnHtpGraph_CustomConfig_t::finalize_optimization(level as f32));
    }
    if let Some(mb) = rt.config.vtcm_mb {
        customs.push(QnnHtpGraph_CustomConfig_t::vtcm_size_in_mb(mb));
    }
    if graph.tensors.iter().any(|t| t.dtype == DType::F32) {
        // Float compute on HTP is FP16; say so instead of relying on the library's default.
        customs.push(QnnHtpGraph_CustomConfig_t::precision(QNN_PRECISION_FLOAT16));
    }
    let configs: Vec<QnnGraph_Config_t> = customs.iter_mut().map(|c| QnnGraph_Config_t::custom((c as *mut QnnHtpGraph_CustomConfig_t).cast())).collect();
    let config_list: Vec<*const QnnGraph_Config_t> = configs.iter().map(|c| c as *const _).chain([null()]).collect();

    let graph_name = CString::new(sanitize(&graph.name)).expect("sanitized");
    let mut handle: Qnn_GraphHandle_t = null_mut();
    let mark = log_mark();
    // SAFETY: name, configs (and the custom configs they point at) and out-pointer are alive.
    let rc = unsafe { graph_create(ctx.handle, graph_name.as_ptr(), config_list.as_ptr(), &mut handle) };
    if rc != QNN_SUCCESS {
        let msg = with_log(format!("graphCreate: {}", rt.message(rc)), &log_errors_since(mark));
        return Err(err("-", "graphCreate".into(), error_code(rc) as u64, msg));
    }

    let mut b = Builder {
        rt,
        graph,
        handle,
        names: Vec::new(),
        dims: Vec::new(),
        axis_scales: Vec::new(),
        lowered: Vec::new(),
        tensors: vec![None; graph.tensors.len()],
        per_tensor_weights: vec![None; graph.tensors.len()],
        n_native: 0,
    };
    for (i, op) in graph.ops.iter().enumerate() {
        b.op(i, op).map_err(|(code, message)| err(op.name(), graph.describe_op(op), code, message))?;
    }

    let mark = log_mark();
    let profile = Profile::new(rt);
    let t = Instant::now();
    // SAFETY: valid graph handle and profile (or NULL); NULL signal.
    let rc = unsafe { finalize(handle, Profile::handle(&profile), null_mut()) };
    let wall_us = t.elapsed().as_micros() as u64;
    if rc != QNN_SUCCESS {
        let log = log_errors_since(mark);
        let (op, shapes) = match culprit(graph, &log) {
            Some(op) => (op.name().to_string(), graph.describe_op(op)),
            // The log did not name a node: name every op.
            None => (
                graph.ops.iter().map(Op::name).collect::<Vec<_>>().join("+"),
                graph.ops.iter().map(|o| format!("[{}]", graph.describe_op(o))).collect::<Vec<_>>().join("; "),
            ),
        };
        let message = with_log(format!("graphFinalize: {}", rt.message(rc)), &log);
        return Err(err(&op, shapes, error_code(rc) as u64, message));
    }

    for (t, id) in inputs.iter_mut().zip(&graph.inputs) {
        // None: an input no op reads; its buffer is checked but not passed.
        t.qnn_id = b.tensors[id.0].map(|t| t.id());
    }
    for (t, id) in outputs.iter_mut().zip(&graph.outputs) {
        t.qnn_id = b.tensors[id.0].map(|t| t.id());
        if t.qnn_id.is_none() {
            return Err(err("-", t.name.clone(), 0, format!("graph output '{}' is not produced by any op", t.name)));
        }
    }
    if let (Some(p), Some(profile)) = (&profiles, &profile) {
        record(p, &graph.name, Origin::Compiled, "prepare", profile.events(), wall_us);
    }
    drop(profile);
    Ok(HtpGraph::new(&graph.name, handle, ctx.clone(), inputs, outputs, Origin::Compiled, profiles))
}
