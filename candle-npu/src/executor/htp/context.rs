//! QNN contexts: owned handles, their binaries, and contexts loaded back from the cache.

use super::*;

/// Owns a context and frees it (with its graphs) on drop; every graph in it holds an `Arc`.
pub(super) struct Context {
    pub(super) rt: Arc<Runtime>,
    pub(super) handle: Qnn_ContextHandle_t,
    /// Executions in this context run one at a time (QNN does not promise that concurrent
    /// graphExecute calls in one context are safe; the HTP runs one graph at a time anyway, and
    /// the scheduler gives the NPU one stage at a time), and never during `contextGetBinary`.
    pub(super) exec: Mutex<()>,
    /// How many graphs the context holds.
    pub(super) graphs: usize,
    /// Context binary size, computed on first request.
    pub(super) binary_size: std::sync::OnceLock<Option<usize>>,
}

// SAFETY: the context handle is opaque and owned by this value; QNN's context calls may come from
// any thread; executions in it (and contextGetBinary) are serialized by `exec`, and
// contextFree runs once, in Drop, after the last graph that held an Arc is gone.
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    pub(super) fn new(rt: &Arc<Runtime>, handle: Qnn_ContextHandle_t, graphs: usize, binary_size: Option<usize>) -> Self {
        let size = std::sync::OnceLock::new();
        if let Some(n) = binary_size {
            let _ = size.set(Some(n));
        }
        Context { rt: rt.clone(), handle, exec: Mutex::new(()), graphs, binary_size: size }
    }

    /// The context binary (contextGetBinarySize + contextGetBinary): the compiled graphs with
    /// their weights. `what` names the graphs in errors.
    pub(super) fn binary(&self, what: &str) -> Result<Vec<u8>> {
        let rt = &self.rt;
        let err = |code: u64, message: String| Error::Execute { graph: what.to_string(), code, message };
        let f = rt.f();
        let (Some(size_of), Some(get)) = (f.contextGetBinarySize, f.contextGetBinary) else {
            return Err(err(0, "library lacks contextGetBinarySize/contextGetBinary".into()));
        };
        let _serial = self.exec.lock().unwrap_or_else(|e| e.into_inner());
        let mut size = 0u64;
        // SAFETY: valid context and out-pointer.
        let rc = unsafe { size_of(self.handle, &mut size) };
        if rc != QNN_SUCCESS {
            return Err(err(error_code(rc) as u64, format!("contextGetBinarySize: {}", rt.message(rc))));
        }
        let mut buf = vec![0u8; size as usize];
        let mut written = 0u64;
        // SAFETY: `buf` has `size` writable bytes; valid out-pointer.
        let rc = unsafe { get(self.handle, buf.as_mut_ptr().cast(), size, &mut written) };
        if rc != QNN_SUCCESS {
            return Err(err(error_code(rc) as u64, format!("contextGetBinary: {}", rt.message(rc))));
        }
        buf.truncate(written as usize);
        let _ = self.binary_size.set(Some(buf.len()));
        Ok(buf)
    }

    /// Creates an empty context for `graphs` graphs, with the HTP's weight sharing if asked.
    pub(super) fn create(rt: &Arc<Runtime>, graphs: usize, weight_sharing: bool) -> std::result::Result<Self, (u64, String)> {
        let create = rt.f().contextCreate.ok_or((0, "library lacks contextCreate".to_string()))?;
        let mut custom = QnnHtpContext_CustomConfig_t::weight_sharing(true);
        let cfg = QnnContext_Config_t::custom((&mut custom as *mut QnnHtpContext_CustomConfig_t).cast());
        let list: [*const QnnContext_Config_t; 2] = [if weight_sharing { &cfg } else { null() }, null()];
        let mut handle: Qnn_ContextHandle_t = null_mut();
        let mark = log_mark();
        // SAFETY: valid out-pointer; the config list is NULL-terminated and it, and the custom
        // config it points at, live across the call.
        let rc = unsafe { create(rt.backend, rt.device, list.as_ptr(), &mut handle) };
        if rc != QNN_SUCCESS {
            let msg = format!("contextCreate (weight sharing: {weight_sharing}): {}", rt.message(rc));
            return Err((error_code(rc) as u64, with_log(msg, &log_errors_since(mark))));
        }
        Ok(Context::new(rt, handle, graphs, None))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if let Some(free) = self.rt.f().contextFree {
            // SAFETY: created by contextCreate(FromBinary), freed once, after its last graph
            // (every graph holds an Arc of it).
            unsafe { free(self.handle, null_mut()) };
        }
    }
}

/// Recreates `graphs` from the cached context binary that holds them: one
/// contextCreateFromBinary, a graphRetrieve per graph. The entry's side table is the graph
/// count, then each graph's input and output tensor ids in order; with the System library, it
/// is checked against the binary's own ids first.
pub(super) fn load_all(
    rt: &Arc<Runtime>,
    system: Option<&QnnSystemLibrary>,
    graphs: &[&Described],
    entry: &CachedGraph,
    profiles: Option<Profiles>,
) -> Result<Vec<HtpGraph>> {
    let name = set_name(graphs);
    let want = 1 + graphs.iter().map(|g| g.inputs.len() + g.outputs.len()).sum::<usize>();
    if entry.meta.first() != Some(&(graphs.len() as u32)) || entry.meta.len() != want {
        return Err(load_error(&name, 0, format!("cache entry's table ({} ids) is not that of these {} graphs ({want})", entry.meta.len(), graphs.len())));
    }
    check_unique_names(graphs)?;
    if let Some(system) = system {
        check_ids(system, graphs, entry).map_err(|why| load_error(&name, 0, format!("cache entry's tensor ids: {why}")))?;
    }
    let ctx = load_context(rt, &entry.payload, graphs.len(), &name, profiles.as_ref())?;
    let mut at = 1;
    graphs
        .iter()
        .map(|g| {
            let n = g.inputs.len() + g.outputs.len();
            at += n;
            retrieve(&ctx, g, &entry.meta[at - n..at], profiles.clone())
        })
        .collect()
}

/// Whether the entry's side table binds each of `graphs`' inputs and outputs to the tensor of
/// that name in the binary (as the System library reads it). The checksum proves the table is
/// the one written, not that it is right: a table edited and re-hashed would otherwise bind,
/// say, a layer's K output to its V buffer without any error.
pub(super) fn check_ids(system: &QnnSystemLibrary, graphs: &[&Described], entry: &CachedGraph) -> std::result::Result<(), String> {
    // A binary the System library cannot read (another version's layout, or one it refuses)
    // is the HTP library's to load or refuse: its ids are trusted, said once per context.
    let io = match system.graph_io(&entry.payload) {
        Ok(io) => io,
        Err(e) => {
            tracing::warn!(error = %e, "cannot check a cached context's tensor ids: trusting them");
            return Ok(());
        }
    };
    let mut at = 1;
    for g in graphs {
        let qnn_name = sanitize(&g.name);
        let found = io.iter().find(|x| x.name == qnn_name).ok_or_else(|| format!("the binary has no graph {qnn_name}"))?;
        for (tensors, held, what) in [(&g.inputs, &found.inputs, "input"), (&g.outputs, &found.outputs, "output")] {
            for t in tensors.iter() {
                let id = entry.meta[at];
                at += 1;
                if id == NO_TENSOR {
                    continue;
                }
                let name = held.iter().find(|(i, _)| *i == id).map(|(_, n)| n.as_str());
                if name != Some(t.qnn_name.as_str()) {
                    let held = name.map_or_else(|| format!("no {what} of the graph"), |n| format!("tensor {n}"));
                    return Err(format!("{what} {} of graph {} is bound to id {id}, which is {held} in the binary", t.qnn_name, g.name));
                }
            }
        }
    }
    Ok(())
}

pub(super) fn load_error(graph: &str, code: u64, message: String) -> Error {
    Error::Prepare { graph: graph.to_string(), op: "-".into(), shapes: "context binary".into(), code, message }
}

/// contextCreateFromBinary of `payload`, a context of `graphs` graphs; its profile is recorded
/// under `what` (a load is of the whole context).
pub(super) fn load_context(rt: &Arc<Runtime>, payload: &[u8], graphs: usize, what: &str, profiles: Option<&Profiles>) -> Result<Arc<Context>> {
    let create = rt.f().contextCreateFromBinary.ok_or_else(|| load_error(what, 0, "library lacks contextCreateFromBinary".into()))?;
    let profile = Profile::new(rt);
    let t = Instant::now();
    let mark = log_mark();
    let mut handle: Qnn_ContextHandle_t = null_mut();
    // SAFETY: the payload outlives the call (QNN copies what it keeps); valid out-pointer.
    let rc = unsafe { create(rt.backend, rt.device, null(), payload.as_ptr().cast(), payload.len() as u64, &mut handle, Profile::handle(&profile)) };
    if rc != QNN_SUCCESS {
        let msg = with_log(format!("contextCreateFromBinary: {}", rt.message(rc)), &log_errors_since(mark));
        return Err(load_error(what, error_code(rc) as u64, msg));
    }
    let ctx = Arc::new(Context::new(rt, handle, graphs, Some(payload.len())));
    if let (Some(p), Some(profile)) = (profiles, &profile) {
        record(p, what, Origin::Loaded, "prepare", profile.events(), t.elapsed().as_micros() as u64);
    }
    Ok(ctx)
}

/// graphRetrieve of `graph` from a loaded context, bound to the tensor ids `ids` (its inputs',
/// then its outputs', as the cache entry recorded them).
pub(super) fn retrieve(ctx: &Arc<Context>, graph: &Described, ids: &[u32], profiles: Option<Profiles>) -> Result<HtpGraph> {
    let rt = &ctx.rt;
    let err = |code, message| load_error(&graph.name, code, message);
    let retrieve = rt.f().graphRetrieve.ok_or_else(|| err(0, "library lacks graphRetrieve".into()))?;
    let name = CString::new(sanitize(&graph.name)).expect("sanitized");
    let mut handle: Qnn_GraphHandle_t = null_mut();
    let mark = log_mark();
    // SAFETY: valid context, name and out-pointer.
    let rc = unsafe { retrieve(ctx.handle, name.as_ptr(), &mut handle) };
    if rc != QNN_SUCCESS {
        let msg = with_log(format!("graphRetrieve '{}': {}", name.to_string_lossy(), rt.message(rc)), &log_errors_since(mark));
        return Err(err(error_code(rc) as u64, msg));
    }
    let bind = |tensors: &[IoTensor], qnn: &[u32]| -> Vec<IoTensor> {
        tensors.iter().zip(qnn).map(|(t, &q)| IoTensor { qnn_id: (q != NO_TENSOR).then_some(q), ..t.clone() }).collect()
    };
    let n_in = graph.inputs.len();
    let inputs = bind(&graph.inputs, &ids[..n_in]);
    let outputs = bind(&graph.outputs, &ids[n_in..]);
    if let Some(t) = outputs.iter().find(|t| t.qnn_id.is_none()) {
        return Err(err(0, format!("cache entry has no tensor id for output '{}'", t.name)));
    }
    Ok(HtpGraph::new(&graph.name, handle, ctx.clone(), inputs, outputs, Origin::Loaded, profiles))
}
