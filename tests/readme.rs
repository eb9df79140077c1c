//! The README's Rust program is `examples/library.rs`, which CI compiles: the two stay the same.

#[test]
fn the_readme_program_is_the_library_example() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let example = std::fs::read_to_string(root.join("examples/library.rs")).unwrap();
    let (start, end) = ("    // README: start\n", "    // README: end");
    let body = &example[example.find(start).expect("start marker") + start.len()..example.find(end).expect("end marker")];
    let mut missing = vec![];
    for line in body.lines() {
        let line = line.strip_prefix("    ").unwrap_or(line);
        if !readme.lines().any(|l| l == line) {
            missing.push(line);
        }
    }
    assert!(missing.is_empty(), "README lacks these lines of examples/library.rs: {missing:#?}");
}
