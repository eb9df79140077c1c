//! The `server` example over HTTP, SmolLM2 on the host executor: the real `openai` Python client
//! (`tests/openai_client.py`: chat and completions, streamed and not, four concurrent streams
//! each against its conversation alone, a 400 the client raises) and curl (a body too large, a
//! malformed one, a busy engine's 503, and a client gone freeing its place).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A running server; killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    /// Starts the example on a free port with `args`, once it says where it listens.
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(common::example("server"))
            .args(["--port", "0"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the server example");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let url = loop {
            let line = lines.next().expect("the server stopped before it listened").unwrap();
            if let Some(url) = line.strip_prefix("listening on ") {
                break url.to_string();
            }
        };
        // Its later logs are drained (a full pipe would block it).
        std::thread::spawn(move || lines.for_each(drop));
        Server { child, url }
    }

    /// curl posting `body` as JSON to `path` (read from its standard input: a large body does
    /// not fit a command line): (HTTP status, response body).
    fn post(&self, path: &str, body: &str) -> (u16, String) {
        use std::io::Write;
        let mut child = Command::new("curl")
            .args(["-s", "-o", "-", "-w", "\n%{http_code}", "-H", "Content-Type: application/json", "--data-binary", "@-"])
            .arg(format!("{}{path}", self.url))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("curl");
        // A refused body may close the connection before curl has sent it all.
        let _ = child.stdin.take().unwrap().write_all(body.as_bytes());
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn chat_body(content: &str, max_tokens: usize, stream: bool) -> String {
    serde_json::json!({"model": "any", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": stream}).to_string()
}

#[test]
fn the_openai_client_and_curl_against_the_server() {
    let server = Server::start(&[]);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let python = candle_npu_models::assets::dir().join("python");
    assert!(python.join("openai").exists(), "{} has no openai client: run scripts/setup.sh", python.display());
    let Output { status, stdout, stderr } = Command::new("python3").arg(&script).arg(&server.url).env("PYTHONPATH", &python).output().unwrap();
    assert!(status.success() && stdout.starts_with(b"ok"), "openai client: {}\n{}", String::from_utf8_lossy(&stdout), String::from_utf8_lossy(&stderr));

    // Bounds, through curl.
    let (code, _) = server.post("/v1/completions", &format!("{{\"prompt\": \"{}\"}}", "a".repeat(2 << 20)));
    assert_eq!(code, 413, "a 2 MiB body");
    let (code, body) = server.post("/v1/chat/completions", "{\"messages\": [");
    assert!(code == 400 && body.contains("request body"), "malformed JSON: {code} {body}");
    let (code, body) = server.post("/v1/chat/completions", &chat_body("Hi", 100_000, false));
    assert!(code == 400 && body.contains("max_tokens"), "max_tokens beyond the context: {code} {body}");
    let (code, body) = server.post("/v1/chat/completions", r#"{"messages": [{"role": "robot", "content": "Hi"}]}"#);
    assert!(code == 400 && body.contains("role"), "an unknown role: {code} {body}");

    // Sampled: a seed gives its answer again; without one, each request draws its own (three
    // 24-token stories at temperature 1 all alike would be a fixed seed).
    let sampled = |seed: Option<u64>| {
        let mut body = serde_json::json!({"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24, "temperature": 1.0});
        if let Some(seed) = seed {
            body["seed"] = seed.into();
        }
        let (code, body) = server.post("/v1/chat/completions", &body.to_string());
        assert_eq!(code, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["choices"][0]["message"]["content"].as_str().expect("an answer").to_string()
    };
    assert_eq!(sampled(Some(5)), sampled(Some(5)), "the same seed");
    let unseeded: std::collections::HashSet<String> = (0..3).map(|_| sampled(None)).collect();
    assert!(unseeded.len() > 1, "three unseeded requests answered alike: {unseeded:?}");
}

#[test]
fn a_busy_server_answers_503_and_a_client_gone_frees_its_place() {
    use std::io::{Read, Write};
    // One conversation at a time, none waiting.
    let server = Server::start(&["--max-sequences", "1", "--queue", "0"]);
    // A long streamed answer (400 tokens: seconds of decode), by hand over a socket, so that the
    // client can leave mid-answer.
    let long = chat_body("Write a long story about a lighthouse keeper.", 400, true);
    let addr = server.url.trim_start_matches("http://").to_string();
    let mut leaver = std::net::TcpStream::connect(&addr).unwrap();
    // A stream that never comes fails the test rather than hanging it.
    leaver.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(leaver, "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{long}", long.len())
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    // Until its answer has begun: the first text chunk after the role's.
    while String::from_utf8_lossy(&seen).matches("data: ").count() < 2 {
        let n = leaver.read(&mut buf).expect("the stream's first chunks within 60 s");
        assert!(n > 0, "the stream ended: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
        assert!(!seen.starts_with(b"HTTP/1.1 ") || seen.starts_with(b"HTTP/1.1 200"), "the first request was refused: {}", String::from_utf8_lossy(&seen));
    }
    let (code, body) = server.post("/v1/chat/completions", &chat_body("Hi", 4, false));
    assert_eq!(code, 503, "a second conversation while the only place is taken: {body}");
    // The client leaves; its place is freed at its next token: a new request is taken well
    // before 400 tokens could have been decoded (SmolLM2 decodes about 100 a second here).
    drop(leaver);
    let left = Instant::now();
    let taken = loop {
        let (code, body) = server.post("/v1/chat/completions", &chat_body("Hi", 4, false));
        match code {
            200 => break left.elapsed(),
            503 if left.elapsed() < Duration::from_secs(20) => std::thread::sleep(Duration::from_millis(20)),
            _ => panic!("{code} {body}"),
        }
    };
    assert!(taken < Duration::from_millis(1500), "the place was freed {taken:?} after the client left: its generation went on");
}
