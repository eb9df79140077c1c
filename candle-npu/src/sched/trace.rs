//! Chrome / Perfetto trace of a schedule, simulated or recorded at run time: one track per
//! processor, so bubbles show as gaps (open in ui.perfetto.dev or chrome://tracing).

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use super::dag::{Node, Processor, SubgraphDag};
use super::sim::Schedule;
use crate::error::Result;

#[derive(Debug, Clone, PartialEq)]
struct Event {
    name: String,
    processor: Processor,
    chunk: usize,
    layer: usize,
    stage: usize,
    rows: usize,
    start_us: f64,
    dur_us: f64,
}

/// Node runs on the two processors, to write as Chrome / Perfetto JSON ([`Trace::to_json`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    events: Vec<Event>,
}

impl Trace {
    /// An empty trace, to [`record`](Self::record) into at run time.
    pub fn new() -> Self {
        Self::default()
    }

    /// One event per slice of `schedule` (simulated or recorded), named after `dag`'s nodes.
    pub fn from_schedule(dag: &SubgraphDag, schedule: &Schedule) -> Self {
        let mut t = Self::new();
        for s in &schedule.slices {
            t.push(dag.node(s.node), s.start * 1e6, (s.end - s.start) * 1e6);
        }
        t
    }

    /// Records one node's run; `start` and `end` are from the same origin, e.g. the prefill's start.
    pub fn record(&mut self, node: &Node, start: Duration, end: Duration) {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        self.push(node, us(start), us(end.saturating_sub(start)));
    }

    fn push(&mut self, node: &Node, start_us: f64, dur_us: f64) {
        self.events.push(Event {
            name: node.name.clone(),
            processor: node.processor,
            chunk: node.chunk,
            layer: node.layer,
            stage: node.stage,
            rows: node.rows,
            start_us,
            dur_us,
        });
    }

    /// Number of node events.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether no node event was recorded.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// `{"traceEvents": [...]}`: thread names (tid 1 = NPU, tid 2 = CPU), then one complete
    /// ("X") event per node, times in microseconds.
    pub fn to_json(&self) -> Value {
        let tid = |p: Processor| p.index() + 1;
        let mut events: Vec<Value> =
            Processor::ALL.iter().map(|&p| json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid(p), "args": {"name": p.name()}})).collect();
        events.extend(self.events.iter().map(|e| {
            json!({
                "name": e.name, "ph": "X", "pid": 1, "tid": tid(e.processor), "ts": e.start_us, "dur": e.dur_us,
                "args": {"chunk": e.chunk, "layer": e.layer, "stage": e.stage, "rows": e.rows},
            })
        }));
        json!({ "traceEvents": events })
    }

    /// Writes the JSON atomically: a unique temporary file in the same folder, renamed into place,
    /// so a viewer never reads half a trace.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        crate::fs::write_atomic(path.as_ref(), |f| Ok(serde_json::to_writer(f, &self.to_json())?))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{chunks, llm_dag};
    use super::super::{simulate, Policy};
    use super::*;

    #[test]
    fn trace_json_has_both_tracks_and_every_node_once() {
        let dag = llm_dag(&chunks(&[4, 4, 2]), 2);
        let s = simulate(&dag, &|n: &Node| 1e-3 * (1 + n.stage) as f64, &Policy::Fifo).unwrap();
        let dir = std::env::temp_dir().join(format!("candle-npu-sched-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("prefill.json");
        Trace::from_schedule(&dag, &s).write(&path).unwrap();
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "the temporary file is renamed");
        let ev = v["traceEvents"].as_array().unwrap();
        let names: Vec<_> = ev.iter().filter(|e| e["ph"] == "M").map(|e| (e["tid"].as_u64(), e["args"]["name"].as_str())).collect();
        assert_eq!(names, [(Some(1), Some("NPU")), (Some(2), Some("CPU"))]);
        let mut seen: Vec<&str> = ev.iter().filter(|e| e["ph"] == "X").map(|e| e["name"].as_str().unwrap()).collect();
        seen.sort();
        let mut want: Vec<&str> = dag.nodes().iter().map(|n| n.name.as_str()).collect();
        want.sort();
        assert_eq!(seen, want);
        for e in ev.iter().filter(|e| e["ph"] == "X") {
            let n = dag.nodes().iter().find(|n| n.name == e["name"]).unwrap();
            assert_eq!(e["tid"].as_u64(), Some(n.processor.index() as u64 + 1));
            assert_eq!(e["args"]["rows"].as_u64(), Some(n.rows as u64));
        }
        let err = Trace::new().write(dir.join("missing/sub/t.json")).unwrap_err().to_string();
        assert!(err.contains("missing/sub/t.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn record_converts_durations_to_microseconds() {
        let dag = llm_dag(&chunks(&[4]), 1);
        let mut t = Trace::new();
        t.record(dag.node(super::super::NodeId(1)), Duration::from_millis(2), Duration::from_micros(2500));
        let e = &t.to_json()["traceEvents"][2];
        assert_eq!((e["ts"].as_f64(), e["dur"].as_f64(), e["tid"].as_u64()), (Some(2000.0), Some(500.0), Some(1)));
    }
}
