//! Resident memory of this process, for the examples' reports and the memory-bound check
//! (Linux and Android: `/proc/self/status`; `None` elsewhere).

/// (current, peak) resident set size in bytes.
pub fn rss() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = |key: &str| s.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()).map(|v| v * 1024);
    Some((kb("VmRSS:")?, kb("VmHWM:")?))
}

/// "current / peak MiB (anonymous, file-backed)" for logs.
pub fn describe() -> String {
    let mib = |b: u64| b as f64 / 1048576.0;
    match (rss(), split()) {
        (Some((c, p)), Some((anon, file))) => {
            format!("{:.0} MiB resident ({:.0} anonymous, {:.0} file-backed), peak {:.0} MiB", mib(c), mib(anon), mib(file), mib(p))
        }
        _ => "resident memory unknown on this OS".into(),
    }
}

/// (anonymous, file-backed) resident bytes: mapped model pages count as file-backed.
pub fn split() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = |key: &str| s.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()).map(|v| v * 1024);
    Some((kb("RssAnon:")?, kb("RssFile:")?))
}

/// Let threads share at most `n` of glibc's heap arenas; true when set (glibc only; elsewhere a
/// no-op that returns false). glibc gives each new thread an arena of its own, which keeps its
/// peak: an out-of-order prefill's chunk workers (`SchedOptions::chunks_in_flight`) would each
/// keep one. Measured on SmolLM2's main job with a 700-token prompt and 4 chunks in flight: peak
/// 402-421 MiB with glibc's default arenas, 396-416 with 1 (the peak depends on how the
/// workers interleave), and no slower (FIFO at 1024 tokens, a core each: 146-189 tok/s with 1
/// arena, 147-161 with the default). Mapping every buffer from 128 KiB up instead
/// (`M_MMAP_THRESHOLD`) cut the peak to 380 MiB but halved the prefill speed (page faults).
/// Process-wide, so for programs to call at start (the examples do), not for libraries.
pub fn limit_malloc_arenas(n: i32) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets an allocator parameter; M_ARENA_MAX takes any positive
        // count and affects arenas created afterwards.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, n.max(1)) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = n;
        false
    }
}
