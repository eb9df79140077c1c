//! A prepared graph: its input and output buffers (shared with the DSP where the device has
//! `libcdsprpc.so`) and its execution.

use super::*;

/// Cache-entry id of an input no op reads (it has no QNN tensor).
pub(super) const NO_TENSOR: u32 = u32::MAX;

#[derive(Clone)]
pub(super) struct IoTensor {
    /// QNN tensor id; `None` for an input no op reads.
    pub(super) qnn_id: Option<u32>,
    pub(super) name: String,
    /// Its name in the QNN graph ([`qnn_tensor_name`]).
    pub(super) qnn_name: String,
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
    pub(super) len: usize,
}

/// Graph inputs and outputs in shared rpcmem buffers registered with the graph's context (on a
/// phone with `libcdsprpc.so`; see [`crate::executor::rpcmem`]): the DSP maps them once instead of FastRPC
/// copying client buffers on every execute. Indexed like the graph's inputs, then outputs;
/// `None` for an input no op reads.
pub(super) struct SharedIo {
    pub(super) rt: Arc<Runtime>,
    pub(super) bufs: Vec<Option<(SharedBuffer, Qnn_MemHandle_t)>>,
}

impl SharedIo {
    /// `None` (client buffers) when `libcdsprpc.so` is absent, as on x86; a failed allocation
    /// or registration is logged and also gives `None`.
    pub(super) fn new(rt: &Arc<Runtime>, ctx: Qnn_ContextHandle_t, graph: &str, io: &[&IoTensor]) -> Option<Self> {
        let mem = RpcMem::load()?;
        let mut shared = SharedIo { rt: rt.clone(), bufs: Vec::with_capacity(io.len()) };
        for t in io {
            if t.qnn_id.is_none() {
                shared.bufs.push(None);
                continue;
            }
            let shape: Vec<u32> = t.shape.iter().map(|&d| d as u32).collect();
            let registered = SharedBuffer::alloc(mem.clone(), t.len * t.dtype.size_in_bytes())
                .map_err(|e| (0, e))
                .and_then(|buf| rpcmem::register(rt.f(), ctx, &buf, qnn_dtype(t.dtype), &shape).map(|h| (buf, h)));
            match registered {
                Ok(pair) => shared.bufs.push(Some(pair)),
                Err((code, msg)) => {
                    let msg = if code == 0 { msg } else { format!("{msg}: {}", rt.message(code as Qnn_ErrorHandle_t)) };
                    tracing::warn!(graph, tensor = %t.name, error = %msg, "shared rpcmem buffer unavailable: this graph uses client buffers");
                    return None; // Drop deregisters what was registered.
                }
            }
        }
        Some(shared)
    }
}

impl Drop for SharedIo {
    fn drop(&mut self) {
        for (_, handle) in self.bufs.iter().flatten() {
            if let Err((_, msg)) = rpcmem::deregister(self.rt.f(), *handle) {
                tracing::warn!(error = %msg, "memDeRegister failed");
            }
        }
        // The buffers are freed (rpcmem_free) after this, when `bufs` drops.
    }
}

/// The bytes of a tensor buffer.
pub(super) fn bytes_of(d: &TensorData) -> &[u8] {
    let b = input_buffer(d);
    // SAFETY: `input_buffer` describes exactly `d`'s allocation, which is borrowed for the
    // lifetime of the returned slice; every bit pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(b.data as *const u8, b.dataSize as usize) }
}

/// The bytes of a tensor buffer, writable.
pub(super) fn bytes_of_mut(d: &mut TensorData) -> &mut [u8] {
    let b = output_buffer(d);
    // SAFETY: as in `bytes_of`, from an exclusive borrow; any bytes are a valid f32/i32/u8/i8.
    unsafe { std::slice::from_raw_parts_mut(b.data as *mut u8, b.dataSize as usize) }
}

/// A finalized graph, in a context of its own or shared with the graphs prepared beside it.
pub(super) struct HtpGraph {
    pub(super) name: String,
    pub(super) handle: Qnn_GraphHandle_t,
    /// Guards the shared buffers, which every execution reuses. Declared before `ctx`:
    /// deregistered before the context can be freed.
    pub(super) exec_lock: Mutex<Option<SharedIo>>,
    /// Freed, with its graphs, when its last graph goes.
    pub(super) ctx: Arc<Context>,
    pub(super) inputs: Vec<IoTensor>,
    pub(super) outputs: Vec<IoTensor>,
    pub(super) origin: Origin,
    pub(super) profiles: Option<Profiles>,
}

impl HtpGraph {
    /// Binds a finalized or loaded graph; sets up shared buffers where the platform has them.
    pub(super) fn new(
        name: &str,
        handle: Qnn_GraphHandle_t,
        ctx: Arc<Context>,
        inputs: Vec<IoTensor>,
        outputs: Vec<IoTensor>,
        origin: Origin,
        profiles: Option<Profiles>,
    ) -> Self {
        let shared = SharedIo::new(&ctx.rt, ctx.handle, name, &inputs.iter().chain(&outputs).collect::<Vec<_>>());
        HtpGraph { name: name.to_string(), handle, exec_lock: Mutex::new(shared), ctx, inputs, outputs, origin, profiles }
    }

    /// Its part of a cache entry's side table: QNN ids of the inputs, then outputs.
    pub(super) fn meta(&self) -> impl Iterator<Item = u32> + '_ {
        self.inputs.iter().chain(&self.outputs).map(|t| t.qnn_id.unwrap_or(NO_TENSOR))
    }
}

// SAFETY: the graph handle belongs to the context owned alongside it; executions (and the
// shared buffers they use) are serialized by `exec_lock`; nothing else is mutated after build.
unsafe impl Send for HtpGraph {}
unsafe impl Sync for HtpGraph {}

/// A client buffer over input data. QNN only reads APP_WRITE buffers; the `*mut` is what the C
/// struct wants.
pub(super) fn input_buffer(d: &TensorData) -> Qnn_ClientBuffer_t {
    let (data, bytes) = match d {
        TensorData::F32(v) => (v.as_ptr() as *mut c_void, v.len() * 4),
        TensorData::U8(v) => (v.as_ptr() as *mut c_void, v.len()),
        TensorData::U16(v) => (v.as_ptr() as *mut c_void, v.len() * 2),
        TensorData::I8(v) => (v.as_ptr() as *mut c_void, v.len()),
        TensorData::I32(v) => (v.as_ptr() as *mut c_void, v.len() * 4),
    };
    Qnn_ClientBuffer_t { data, dataSize: bytes as u32 }
}

/// A client buffer QNN writes an output into.
pub(super) fn output_buffer(d: &mut TensorData) -> Qnn_ClientBuffer_t {
    match d {
        TensorData::F32(v) => Qnn_ClientBuffer_t::from_slice(v),
        TensorData::U8(v) => Qnn_ClientBuffer_t::from_slice(v),
        TensorData::U16(v) => Qnn_ClientBuffer_t::from_slice(v),
        TensorData::I8(v) => Qnn_ClientBuffer_t::from_slice(v),
        TensorData::I32(v) => Qnn_ClientBuffer_t::from_slice(v),
    }
}

impl ExecutableGraph for HtpGraph {
    fn execute(&self, inputs: &[&TensorData]) -> Result<Vec<TensorData>> {
        check_input_count(&self.name, self.inputs.len(), inputs.len())?;
        // graphExecute does not check client buffer sizes (it overruns): check every one here.
        let check = |t: &IoTensor, data: &TensorData| check_buffer(&self.name, &t.name, t.dtype, t.len, data);
        let rt = &self.ctx.rt;
        let execute = rt.f().graphExecute.ok_or_else(|| Error::Execute { graph: self.name.clone(), code: 0, message: "library lacks graphExecute".into() })?;
        let mut shared = self.exec_lock.lock().unwrap_or_else(|e| e.into_inner());
        let _context = self.ctx.exec.lock().unwrap_or_else(|e| e.into_inner());
        let n_in = self.inputs.len();
        let mut exec_in = Vec::with_capacity(inputs.len());
        for (i, (t, data)) in self.inputs.iter().zip(inputs).enumerate() {
            check(t, data)?;
            let Some(id) = t.qnn_id else { continue };
            match shared.as_mut().and_then(|s| s.bufs[i].as_mut()) {
                Some((buf, handle)) => {
                    buf.as_mut_slice().copy_from_slice(bytes_of(data));
                    exec_in.push(Qnn_Tensor_t::for_execute_mem_handle(id, *handle));
                }
                None => exec_in.push(Qnn_Tensor_t::for_execute(id, input_buffer(data))),
            }
        }
        let mut out: Vec<TensorData> = self.outputs.iter().map(|t| TensorData::zeros(t.dtype, t.len)).collect();
        let mut exec_out = Vec::with_capacity(out.len());
        for (i, (t, data)) in self.outputs.iter().zip(out.iter_mut()).enumerate() {
            check(t, data)?;
            let id = t.qnn_id.expect("checked in build");
            match shared.as_ref().and_then(|s| s.bufs[n_in + i].as_ref()) {
                Some((_, handle)) => exec_out.push(Qnn_Tensor_t::for_execute_mem_handle(id, *handle)),
                None => exec_out.push(Qnn_Tensor_t::for_execute(id, output_buffer(data))),
            }
        }
        let mark = log_mark();
        let profile = Profile::new(rt);
        let t = Instant::now();
        // SAFETY: every client buffer was checked against its tensor's size above (shared
        // buffers were allocated at that size) and outlives the call; QNN only reads the input buffers and writes the output buffers, whose pointers
        // come from exclusive borrows of `out`, which is not accessed until the call returns.
        let rc = unsafe {
            execute(self.handle, exec_in.as_ptr(), exec_in.len() as u32, exec_out.as_mut_ptr(), exec_out.len() as u32, Profile::handle(&profile), null_mut())
        };
        let wall_us = t.elapsed().as_micros() as u64;
        if rc != QNN_SUCCESS {
            let message = with_log(rt.message(rc), &log_errors_since(mark));
            return Err(Error::Execute { graph: self.name.clone(), code: error_code(rc) as u64, message });
        }
        if let Some(shared) = shared.as_ref() {
            for (data, (buf, _)) in out.iter_mut().zip(&shared.bufs[n_in..]).filter_map(|(d, b)| Some((d, b.as_ref()?))) {
                bytes_of_mut(data).copy_from_slice(buf.as_slice());
            }
        }
        if let (Some(p), Some(profile)) = (&self.profiles, &profile) {
            record(p, &self.name, self.origin, "execute", profile.events(), wall_us);
        }
        Ok(out)
    }

    fn origin(&self) -> Origin {
        self.origin
    }

    fn serialized_size(&self) -> Option<usize> {
        if let Some(&size) = self.ctx.binary_size.get() {
            return size;
        }
        let size =
            self.ctx.binary(&self.name).map_err(|e| tracing::warn!(graph = %self.name, error = %e, "context binary size unavailable")).ok().map(|b| b.len());
        *self.ctx.binary_size.get_or_init(|| size)
    }

    fn graphs_in_unit(&self) -> usize {
        self.ctx.graphs
    }
}
