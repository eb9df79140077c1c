//! QNN profiling of prepare, load and execute, per graph.

use super::*;

/// Per-graph profiles, shared by the executor and its graphs, keyed by graph name.
pub(super) type Profiles = Arc<Mutex<BTreeMap<String, GraphProfile>>>;

/// A QNN profile handle for one call, freed on drop.
pub(super) struct Profile<'a> {
    pub(super) rt: &'a Runtime,
    pub(super) handle: Qnn_ProfileHandle_t,
}

impl<'a> Profile<'a> {
    /// A fresh profile at the configured level; `None` when profiling is off or the library
    /// refuses (logged: the call then runs unprofiled).
    pub(super) fn new(rt: &'a Runtime) -> Option<Self> {
        let level = match rt.config.profiling? {
            ProfilingLevel::Basic => QNN_PROFILE_LEVEL_BASIC,
            ProfilingLevel::Detailed => QNN_PROFILE_LEVEL_DETAILED,
        };
        let create = rt.f().profileCreate?;
        let mut handle = null_mut();
        // SAFETY: valid backend and out-pointer.
        let rc = unsafe { create(rt.backend, level, &mut handle) };
        if rc != QNN_SUCCESS {
            tracing::warn!(error = %rt.message(rc), "profileCreate failed: running without profiling");
            return None;
        }
        Some(Profile { rt, handle })
    }

    pub(super) fn handle(p: &Option<Self>) -> Qnn_ProfileHandle_t {
        p.as_ref().map_or(null_mut(), |p| p.handle)
    }

    /// Every event, sub-events included (their names prefixed with the parent's).
    pub(super) fn events(&self) -> Vec<(String, u32, u64)> {
        let f = self.rt.f();
        let (Some(get_events), Some(get_sub), Some(get_data)) = (f.profileGetEvents, f.profileGetSubEvents, f.profileGetEventData) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut ids: *const QnnProfile_EventId_t = null();
        let mut n = 0u32;
        // SAFETY: valid profile handle and out-pointers; QNN owns the id array until the profile
        // is freed, which happens after this borrow ends.
        if unsafe { get_events(self.handle, &mut ids, &mut n) } != QNN_SUCCESS || ids.is_null() {
            return out;
        }
        let mut stack: Vec<(QnnProfile_EventId_t, String)> =
            unsafe { std::slice::from_raw_parts(ids, n as usize) }.iter().map(|&id| (id, String::new())).collect();
        stack.reverse();
        while let Some((id, parent)) = stack.pop() {
            let mut data = QnnProfile_EventData_t::default();
            // SAFETY: id comes from this profile; out-pointer valid.
            if unsafe { get_data(id, &mut data) } != QNN_SUCCESS {
                continue;
            }
            let name = if data.identifier.is_null() {
                format!("event type {}", data.type_)
            } else {
                // SAFETY: a NUL-terminated string owned by the profile.
                unsafe { CStr::from_ptr(data.identifier) }.to_string_lossy().into_owned()
            };
            let name = if parent.is_empty() { name } else { format!("{parent} / {name}") };
            let (mut sub, mut m) = (null(), 0u32);
            // SAFETY: as above.
            if unsafe { get_sub(id, &mut sub, &mut m) } == QNN_SUCCESS && !sub.is_null() {
                for &s in unsafe { std::slice::from_raw_parts(sub, m as usize) }.iter().rev() {
                    stack.push((s, name.clone()));
                }
            }
            out.push((name, data.unit, data.value));
        }
        out
    }
}

impl Drop for Profile<'_> {
    fn drop(&mut self) {
        if let Some(free) = self.rt.f().profileFree {
            // SAFETY: created by profileCreate, freed once, after its last use.
            unsafe { free(self.handle) };
        }
    }
}

pub(super) fn unit_name(unit: u32) -> &'static str {
    match unit {
        QNN_PROFILE_EVENTUNIT_MICROSEC => "us",
        QNN_PROFILE_EVENTUNIT_BYTES => "bytes",
        QNN_PROFILE_EVENTUNIT_CYCLES => "cycles",
        QNN_PROFILE_EVENTUNIT_COUNT => "count",
        _ => "?",
    }
}

/// Adds one call's events to the graph's profile. The call's time is QNN's own top-level
/// "QNN (...) time" event when there is one, else `wall_us`.
pub(super) fn record(profiles: &Profiles, graph: &str, origin: Origin, phase: &'static str, events: Vec<(String, u32, u64)>, wall_us: u64) {
    let qnn_us = events.iter().find(|(n, u, _)| *u == QNN_PROFILE_EVENTUNIT_MICROSEC && n.starts_with("QNN (") && !n.contains(" / ")).map_or(wall_us, |e| e.2);
    let mut map = profiles.lock().unwrap_or_else(|e| e.into_inner());
    let p = map.entry(graph.to_string()).or_insert_with(|| GraphProfile {
        graph: graph.to_string(),
        origin,
        prepare_us: 0,
        executions: 0,
        execute_us: 0,
        events: Vec::new(),
    });
    if phase == "prepare" {
        p.origin = origin;
        p.prepare_us += qnn_us;
    } else {
        p.executions += 1;
        p.execute_us += qnn_us;
    }
    for (name, unit, value) in events {
        match p.events.iter_mut().find(|e| e.phase == phase && e.name == name) {
            Some(e) => {
                e.value += value;
                e.calls += 1;
            }
            None => p.events.push(ProfileEvent { phase, name, unit: unit_name(unit), value, calls: 1 }),
        }
    }
}
