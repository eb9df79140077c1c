//! Several conversations on one loaded model (`candle_npu_models::serve`), SmolLM2 on the host
//! executor: each answer equals its conversation's run alone (`Pipeline::generate`), greedy and
//! sampled; a full queue refuses; a client gone is cancelled and the others go on.

mod common;

use std::sync::mpsc::channel;
use std::sync::Arc;

use candle_npu::NpuDevice;
use candle_npu_models::serve::{Engine, Event, Limits, Request};
use candle_npu_models::{CalibrationSet, DecodeWeights, GenerateOptions, Message, Pipeline, Precision, StopReason};

fn pipeline() -> Arc<Pipeline> {
    let mut p = common::smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Checkpoint);
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {}).unwrap();
    Arc::new(p)
}

/// Each conversation's events, in the order they came, once every conversation sent its last.
fn answers(engine: &Engine, p: &Pipeline, asks: &[(&str, GenerateOptions)], cancel_after: Option<usize>) -> Vec<Vec<Event>> {
    let (tx, rx) = channel();
    for (i, (q, opts)) in asks.iter().enumerate() {
        let prompt = p.encode_chat(&[Message::user(*q)], true, false).unwrap();
        let tx = tx.clone();
        let mut texts = 0;
        // Conversation `cancel_after`'s client goes away after its first piece of text.
        let events = Box::new(move |e: Event| {
            texts += matches!(e, Event::Text(_)) as usize;
            tx.send((i, e)).is_ok() && !(cancel_after == Some(i) && texts >= 1)
        });
        assert!(engine.submit(Request { prompt, opts: opts.clone(), events }).is_ok(), "the queue has room for {} requests", asks.len());
    }
    drop(tx);
    let mut out = vec![vec![]; asks.len()];
    // Ends when the engine has dropped every conversation's callback.
    for (i, e) in rx {
        out[i].push(e);
    }
    out
}

fn text(events: &[Event]) -> String {
    events.iter().filter_map(|e| if let Event::Text(t) = e { Some(t.as_str()) } else { None }).collect()
}

#[test]
fn conversations_at_once_answer_as_each_alone() {
    let p = pipeline();
    let greedy = GenerateOptions { sample_len: 24, ..Default::default() };
    let sampled = GenerateOptions { temperature: Some(0.8), seed: 7, ..greedy.clone() };
    let asks = [
        ("What is the capital of France?", greedy.clone()),
        ("Write a haiku about the sea.", sampled),
        ("List three prime numbers.", greedy.clone()),
        ("My name is Bob and I live in Tokyo.", greedy.clone()),
    ];
    let alone: Vec<(String, StopReason)> = asks
        .iter()
        .map(|(q, o)| {
            let (t, s) = p.generate(q, o, |_| {}).unwrap();
            (t, s.stop)
        })
        .collect();
    let engine = Engine::start(p.clone(), Limits { sequences: 4, queue: 8 }).unwrap();
    let got = answers(&engine, &p, &asks, None);
    for (i, ((want, stop), events)) in alone.iter().zip(&got).enumerate() {
        assert_eq!(&text(events), want, "conversation {i} ({}) answered otherwise than alone", asks[i].0);
        match events.last() {
            Some(Event::Done(f)) => assert_eq!(f.stop, *stop, "conversation {i}"),
            other => panic!("conversation {i} ended with {other:?}"),
        }
    }
    assert!(alone.iter().all(|(t, _)| !t.is_empty()), "every conversation answered something");

    // Conversation 1's client leaves after its first piece: it gets nothing more, the others
    // answer as before.
    let got = answers(&engine, &p, &asks, Some(1));
    assert_eq!(got[1].iter().filter(|e| matches!(e, Event::Text(_))).count(), 1, "{:?}", got[1]);
    assert!(!got[1].iter().any(|e| matches!(e, Event::Done(_))), "a cancelled conversation is not finished: {:?}", got[1]);
    for i in [0, 2, 3] {
        assert_eq!(text(&got[i]), alone[i].0, "conversation {i} beside a cancelled one");
    }
}

#[test]
fn a_full_queue_refuses_and_a_bad_request_fails_alone() {
    let p = pipeline();
    let opts = GenerateOptions { sample_len: 8, ..Default::default() };
    let engine = Engine::start(p.clone(), Limits { sequences: 1, queue: 1 }).unwrap();
    let prompt = p.encode_chat(&[Message::user("Hello")], true, false).unwrap();
    // Submitted within microseconds while the loop prefills the first: one place in the queue.
    let (tx, rx) = channel();
    let mut refused = 0;
    for i in 0..4 {
        let tx = tx.clone();
        let r = Request { prompt: prompt.clone(), opts: opts.clone(), events: Box::new(move |e| tx.send((i, e)).is_ok()) };
        refused += engine.submit(r).is_err() as usize;
    }
    drop(tx);
    let done = rx.iter().filter(|(_, e)| matches!(e, Event::Done(_))).count();
    assert!(refused >= 2, "a queue of one beside one conversation took {} of 4", 4 - refused);
    assert_eq!(done, 4 - refused, "every request taken is answered");
    // An empty prompt and one that fills the context fail with a reason; the engine goes on.
    let context = p.model.config().context_len;
    for (bad, why) in [(vec![], "empty prompt"), (vec![1; context], "no room")] {
        let (tx, rx) = channel();
        engine.submit(Request { prompt: bad, opts: opts.clone(), events: Box::new(move |e| tx.send(e).is_ok()) }).ok().unwrap();
        match rx.recv().unwrap() {
            Event::Error(e) => assert!(e.contains(why), "{e}"),
            other => panic!("expected an error, got {other:?}"),
        }
    }
    let got = answers(&engine, &p, &[("Hello", opts.clone())], None);
    assert!(matches!(got[0].last(), Some(Event::Done(_))), "{:?}", got[0]);
}
