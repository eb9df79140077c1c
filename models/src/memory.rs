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
        (Some((c, p)), Some((anon, file))) => format!("{:.0} MiB resident ({:.0} anonymous, {:.0} file-backed), peak {:.0} MiB", mib(c), mib(anon), mib(file), mib(p)),
        _ => "resident memory unknown on this OS".into(),
    }
}

/// (anonymous, file-backed) resident bytes: mapped model pages count as file-backed.
pub fn split() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = |key: &str| s.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()).map(|v| v * 1024);
    Some((kb("RssAnon:")?, kb("RssFile:")?))
}
