//! An OpenAI-compatible HTTP server on one loaded model: `/v1/chat/completions` (in the model's
//! own chat template) and `/v1/completions`, each streamed (server-sent events) or not, and
//! `/v1/models`. Several conversations run at once on the one model
//! (`candle_npu_models::serve`): their decode steps share one pass over the weights, a new
//! request's prefill goes between steps, and each answer is what it would be alone.
//!
//! ```text
//! cargo run --release --example server -- --port 8080
//! curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \
//!   -d '{"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
//! ```
//!
//! Bounded: request bodies (`--max-body-bytes`, 413 beyond), prompts (the model's context, 400
//! beyond), answers (`max_tokens` at most what the context leaves), conversations at once
//! (`--max-sequences`) and waiting (`--queue`; a full queue answers 503 with `Retry-After`). A
//! client that disconnects cancels its generation at the next token.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use candle_npu::NpuDevice;
use candle_npu_models::serve::{Engine, Event, Finish, Limits, Request};
use candle_npu_models::{CalibrationSet, GenerateOptions, LoadOptions, Message, Pipeline, StopReason};
use clap::{Parser, ValueEnum};
use futures_util::stream::{self, Stream};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// The allocator that bounds the memory a model's chat template may take while it renders
/// (`candle_npu_models::sandbox`): a template comes with a downloaded file.
#[global_allocator]
static ALLOC: candle_npu_models::sandbox::GuardedAlloc = candle_npu_models::sandbox::GuardedAlloc;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ExecutorKind {
    Host,
    Hexagon,
    /// The host executor with the HTP library's numerics.
    HtpModel,
}

#[derive(Parser, Debug)]
#[command(about = "candle-npu: an OpenAI-compatible server, NPU prefill + CPU decode")]
struct Args {
    /// Local GGUF file or HF folder (default: SmolLM2-135M-Instruct from scripts/setup.sh).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Where prefill runs.
    #[arg(long, value_enum, default_value = "host")]
    executor: ExecutorKind,
    /// Conversations decoded together (each holds its own KV cache).
    #[arg(long, default_value_t = 4)]
    max_sequences: usize,
    /// Requests waiting for a place; beyond them the server answers 503.
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// The largest request body taken (413 beyond).
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
}

struct App {
    p: Arc<Pipeline>,
    engine: Engine,
    /// The name `/v1/models` gives (the model file's stem); any name is accepted in requests.
    name: String,
    next_id: AtomicU64,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,server=info".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let path = args.model.clone().unwrap_or_else(candle_npu_models::assets::smollm2);
    if !candle_npu::fs::exists(&path)? {
        bail!("model {} not found: run scripts/setup.sh, or pass --model", path.display());
    }
    let device = match args.executor {
        ExecutorKind::Host => NpuDevice::host(),
        ExecutorKind::HtpModel => NpuDevice::host_with(candle_npu::Numerics::Htp),
        ExecutorKind::Hexagon => {
            NpuDevice::hexagon(Default::default()).context("starting the Hexagon executor (run scripts/setup.sh, or set CANDLE_NPU_QNN_LIB_DIR)")?
        }
    };
    let mut p = Pipeline::load(&path, None, &device, LoadOptions::default()).with_context(|| format!("loading {}", path.display()))?;
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {}).context("the quant profile")?;
    p.model.prepare().context("preparing the NPU graphs")?;
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let p = Arc::new(p);
    let engine = Engine::start(p.clone(), Limits { sequences: args.max_sequences, queue: args.queue })?;
    let app = Arc::new(App { p, engine, name, next_id: AtomicU64::new(1) });
    let router = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .layer(DefaultBodyLimit::max(args.max_body_bytes))
        .with_state(app);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", args.host, args.port).parse().with_context(|| format!("--host {} --port {}", args.host, args.port))?;
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("listening on {addr}"))?;
        // Tests and scripts wait for this line.
        eprintln!("listening on http://{}", listener.local_addr()?);
        axum::serve(listener, router)
            .with_graceful_shutdown(async {
                tokio::signal::ctrl_c().await.ok();
            })
            .await?;
        Ok(())
    })
}

/// An OpenAI-style error body with `status`.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
    (status, Json(json!({"error": {"message": message.into(), "type": kind, "code": status.as_u16()}}))).into_response()
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": app.name, "object": "model", "created": 0, "owned_by": "candle-npu"}]}))
}

/// The sampling fields both endpoints take.
#[derive(Deserialize, Default)]
struct Sampling {
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    n: Option<usize>,
    stop: Option<Value>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<ChatMessage>,
    #[serde(flatten)]
    sampling: Sampling,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    content: Content,
}

/// A message's content: a string, or an array of parts of which only text is taken.
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: String,
    #[serde(flatten)]
    sampling: Sampling,
}

/// `GenerateOptions` from the request, within what the model's context leaves after `prompt`
/// tokens; a message for a 400 otherwise.
fn options(s: &Sampling, prompt: usize, context: usize) -> std::result::Result<GenerateOptions, String> {
    if s.n.is_some_and(|n| n != 1) {
        return Err("n: one answer per request is served".into());
    }
    if s.stop.as_ref().is_some_and(|v| !v.is_null()) {
        return Err("stop: stop sequences are not supported (the model's own stop tokens end an answer)".into());
    }
    if prompt == 0 {
        return Err("an empty prompt: nothing to answer".into());
    }
    if prompt >= context {
        return Err(format!("the prompt is {prompt} tokens: the model's context is {context}"));
    }
    let room = context - prompt;
    let sample_len = s.max_completion_tokens.or(s.max_tokens).unwrap_or(room.min(512));
    if sample_len == 0 || sample_len > room {
        return Err(format!("max_tokens {sample_len}: between 1 and {room} (what the context leaves after the prompt's {prompt} tokens)"));
    }
    if s.temperature.is_some_and(|t| !(0.0..=2.0).contains(&t)) {
        return Err(format!("temperature {:?}: between 0 and 2", s.temperature));
    }
    // A request without a seed samples with a fresh one (as OpenAI's API does): a fixed default
    // gave every unseeded request at the same prompt and temperature the same answer.
    let seed = s.seed.unwrap_or_else(rand::random);
    let opts = GenerateOptions { sample_len, temperature: s.temperature, top_p: s.top_p, seed, ..Default::default() };
    opts.validate().map_err(|e| e.to_string())?;
    Ok(opts)
}

/// The JSON body as `T`, or what is wrong with it.
fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> std::result::Result<T, String> {
    serde_json::from_slice(body).map_err(|e| format!("request body: {e}"))
}

async fn chat(State(app): State<Arc<App>>, body: axum::body::Bytes) -> Response {
    let body: ChatBody = match parse(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let mut messages = Vec::with_capacity(body.messages.len());
    for m in body.messages {
        let text = match m.content {
            Content::Text(t) => t,
            Content::Parts(parts) => match parts.iter().all(|p| p.kind == "text") {
                true => parts.into_iter().filter_map(|p| p.text).collect::<Vec<_>>().join("\n"),
                false => return error(StatusCode::BAD_REQUEST, "content: only text parts are taken"),
            },
        };
        messages.push(match m.role.as_str() {
            "system" | "developer" => Message::system(text),
            "user" => Message::user(text),
            "assistant" => Message::assistant(text),
            other => return error(StatusCode::BAD_REQUEST, format!("role {other:?}: system, user or assistant")),
        });
    }
    let prompt = match app.p.encode_chat(&messages, true, false) {
        Ok(ids) => ids,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    answer(app, prompt, body.sampling, Kind::Chat).await
}

async fn completions(State(app): State<Arc<App>>, body: axum::body::Bytes) -> Response {
    let body: CompletionBody = match parse(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let prompt = match app.p.encode(&body.prompt, false) {
        Ok(ids) => ids,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    answer(app, prompt, body.sampling, Kind::Completion).await
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

/// Queues the request and answers it, streamed or whole.
async fn answer(app: Arc<App>, prompt: Vec<u32>, sampling: Sampling, kind: Kind) -> Response {
    let opts = match options(&sampling, prompt.len(), app.p.model.config().context_len) {
        Ok(o) => o,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let (tx, rx) = unbounded_channel();
    // The receiver dropped (the client gone) makes this false: the engine cancels.
    let request = Request { prompt, opts, events: Box::new(move |e| tx.send(e).is_ok()) };
    if app.engine.submit(request).is_err() {
        let mut r = error(StatusCode::SERVICE_UNAVAILABLE, "every place is taken: try again shortly");
        r.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return r;
    }
    let id = format!("{}-{}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, app.next_id.fetch_add(1, Ordering::Relaxed));
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let meta = Meta { id, created, model: app.name.clone(), kind };
    match sampling.stream {
        true => Sse::new(stream_events(meta, rx)).keep_alive(KeepAlive::default()).into_response(),
        false => whole(meta, rx).await,
    }
}

/// What every response and chunk of one answer carries.
struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// A streamed chunk: `text` (a chat's delta content, or a completion's text), a chat's
    /// first chunk saying the role, the last one the finish reason and usage.
    fn chunk(&self, text: &str, first: bool, finish: Option<&Finish>) -> SseEvent {
        let reason = finish.map(finish_reason);
        let choice = match self.kind {
            Kind::Chat if first => json!({"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": null}),
            Kind::Chat if finish.is_some() => json!({"index": 0, "delta": {}, "finish_reason": reason, "logprobs": null}),
            Kind::Chat => json!({"index": 0, "delta": {"content": text}, "finish_reason": reason, "logprobs": null}),
            Kind::Completion => json!({"index": 0, "text": text, "finish_reason": reason, "logprobs": null}),
        };
        let mut c = json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]});
        if let Some(f) = finish {
            c["usage"] = usage(f);
        }
        SseEvent::default().data(c.to_string())
    }
}

fn finish_reason(f: &Finish) -> &'static str {
    match f.stop {
        StopReason::StopToken => "stop",
        StopReason::SampleLen | StopReason::ContextFull => "length",
    }
}

fn usage(f: &Finish) -> Value {
    json!({"prompt_tokens": f.prompt_tokens, "completion_tokens": f.generated_tokens, "total_tokens": f.prompt_tokens + f.generated_tokens})
}

/// The whole answer in one response (a client gone drops this future, and the receiver with
/// it: the engine cancels).
async fn whole(meta: Meta, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut text = String::new();
    while let Some(e) = rx.recv().await {
        match e {
            Event::Text(t) => text += &t,
            Event::Error(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e),
            Event::Done(f) => {
                let choice = match meta.kind {
                    Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason(&f), "logprobs": null}),
                    Kind::Completion => json!({"index": 0, "text": text, "finish_reason": finish_reason(&f), "logprobs": null}),
                };
                let body =
                    json!({"id": meta.id, "object": meta.object(false), "created": meta.created, "model": meta.model, "choices": [choice], "usage": usage(&f)});
                return Json(body).into_response();
            }
        }
    }
    error(StatusCode::INTERNAL_SERVER_ERROR, "the engine stopped before the answer ended")
}

/// Where a stream of server-sent events is.
enum Phase {
    /// A chat's first chunk (the role) is next.
    Role,
    /// Text chunks, until the answer ends.
    Body,
    /// `[DONE]` is next.
    Done,
    End,
}

/// Server-sent events: a chunk per text piece (a chat's first says the role), the last with the
/// finish reason and usage, then `[DONE]`.
fn stream_events(meta: Meta, rx: UnboundedReceiver<Event>) -> impl Stream<Item = std::result::Result<SseEvent, std::convert::Infallible>> {
    let start = if meta.kind == Kind::Chat { Phase::Role } else { Phase::Body };
    stream::unfold((meta, rx, start), |(meta, mut rx, phase)| async move {
        let (event, next) = match phase {
            Phase::End => return None,
            Phase::Done => (SseEvent::default().data("[DONE]"), Phase::End),
            Phase::Role => (meta.chunk("", true, None), Phase::Body),
            Phase::Body => match rx.recv().await {
                Some(Event::Text(t)) => (meta.chunk(&t, false, None), Phase::Body),
                Some(Event::Done(f)) => (meta.chunk("", false, Some(&f)), Phase::Done),
                Some(Event::Error(e)) => (SseEvent::default().data(json!({"error": {"message": e, "type": "server_error"}}).to_string()), Phase::Done),
                None => (SseEvent::default().data(json!({"error": {"message": "the engine stopped", "type": "server_error"}}).to_string()), Phase::Done),
            },
        };
        Some((Ok(event), (meta, rx, next)))
    })
}
