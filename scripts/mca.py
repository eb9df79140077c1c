#!/usr/bin/env python3
"""llvm-mca estimate of one function's innermost loop on an aarch64 core model.

Given an aarch64 object, archive (.rlib/.a), executable or assembly file and a symbol, this
disassembles the function, finds its loops (a backward branch and its target: the instructions
between the target and the branch), picks the innermost one (by default the innermost loop with
the most of the --count mnemonic, else with the most SIMD instructions, so that a tail or
reduction loop is not taken for the main loop; --loop I overrides), writes it as
llvm-mca input and runs

    llvm-mca-16 -mtriple=aarch64 -mcpu=<model> -mattr=+dotprod,+i8mm,+fullfp16 -iterations=200

It reports cycles per iteration (Total Cycles / iterations), the Block RThroughput (the bound
from the busiest resource alone), the busiest resource, and cycles per unit of work when told
how much work one iteration does (--units N, or --count MNEMONIC --per K: units = occurrences of
MNEMONIC in the loop / K, e.g. `--count sdot --per 2` for Q8_0 blocks of 32 weights;
`--count @f32` counts the f32 values the loop loads, `--count @st32` those it stores).

These are model estimates: llvm-mca assumes every load hits L1, and a forward branch inside the
loop is costed as an instruction with its path always taken through.

Usage:
    scripts/mca.py OBJ SYMBOL [--mcpu cortex-a715] [--loop I] [--units N | --count M --per K]
                   [--has MNEMONIC] [--list] [--show] [--json]
SYMBOL matches a substring of the demangled name (the first defined function that matches;
use a longer substring or --exact to disambiguate).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

OBJDUMP = os.environ.get("OBJDUMP", "aarch64-linux-gnu-objdump")
AS = os.environ.get("AS", "aarch64-linux-gnu-as")
MCA = os.environ.get("LLVM_MCA", "llvm-mca-16")
MATTR = "+dotprod,+i8mm,+fullfp16"
BRANCH = re.compile(r"^(b|b\.\w+|cbz|cbnz|tbz|tbnz)$")


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def assemble_if_needed(path, tmp):
    """An assembly file is assembled first, so objects and .s go through one path."""
    if path.endswith(".s") or path.endswith(".S"):
        out = os.path.join(tmp, "in.o")
        run([AS, "-march=armv8.2-a+dotprod+i8mm+fp16", "-o", out, path])
        return out
    return path


def disassemble(obj):
    """objdump's text, cached beside the object's path and modification time in $MCA_CACHE
    (default /tmp/mca-cache): a test binary takes seconds to disassemble and a table asks often."""
    cache = os.environ.get("MCA_CACHE", "/tmp/mca-cache")
    st = os.stat(obj)
    key = re.sub(r"[^\w.-]", "_", os.path.abspath(obj)) + f".{st.st_mtime_ns}.{st.st_size}.txt"
    path = os.path.join(cache, key)
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    text = run([OBJDUMP, "-d", "-C", "--no-show-raw-insn", obj])
    os.makedirs(cache, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return text


def functions(obj):
    """Every function in the disassembly: {name: [(addr, mnemonic, operands)]}."""
    text = disassemble(obj)
    funcs, cur = {}, None
    head = re.compile(r"^([0-9a-f]+) <(.*)>:$")
    insn = re.compile(r"^\s+([0-9a-f]+):\s+(\S+)\s*(.*)$")
    for line in text.splitlines():
        m = head.match(line)
        if m:
            # Monomorphized copies share a demangled name: the second is `name#2`, and so on.
            cur, n = m.group(2), 2
            while cur in funcs:
                cur, n = f"{m.group(2)}#{n}", n + 1
            funcs[cur] = []
            continue
        m = insn.match(line)
        if m and cur is not None:
            ops = m.group(3).split("//")[0].strip()
            funcs[cur].append((int(m.group(1), 16), m.group(2), ops))
    return funcs


def pick_function(funcs, symbol, exact, fn_has=None):
    names = [n for n in funcs if ((n == symbol or n.split("#")[0] == symbol) if exact else symbol in n) and funcs[n]]
    if fn_has:
        names = [n for n in names if any(m == fn_has for _, m, _ in funcs[n])]
    if not names:
        sys.exit(f"mca.py: no function matching {symbol!r}")
    # Prefer the largest match when several share the substring (e.g. a closure next to its fn).
    names.sort(key=lambda n: -len(funcs[n]))
    return names[0], names


def branch_target(ops):
    m = re.search(r"(?:^|,\s*)([0-9a-f]+)\s+<", ops)
    return int(m.group(1), 16) if m else None


def is_simd(mn, ops):
    return bool(re.search(r"\b[vq]\d+\b|\bv\d+\.|\b[sdh]\d+\b", ops)) or mn in ("sdot", "udot", "smmla", "ummla")


def loops(insns):
    """(start_index, end_index) for every backward branch; end is the branch itself."""
    index = {a: i for i, (a, _, _) in enumerate(insns)}
    out = []
    for i, (a, mn, ops) in enumerate(insns):
        if BRANCH.match(mn):
            t = branch_target(ops)
            if t is not None and t <= a and t in index:
                out.append((index[t], i))
    return out


def innermost(ls):
    """Loops containing no other loop."""
    return [l for l in ls if not any(o != l and l[0] <= o[0] and o[1] <= l[1] for o in ls)]


def count(body, what):
    """Occurrences of a mnemonic in the loop; `@f32` counts the f32 values loaded (4 per q
    register of an ldr/ldur/ldp/ld1, 1 per s register; not stack reloads), `@st32` those
    stored: the work measure
    of a row kernel (values in, or values out when it reads two inputs per output)."""
    if what in ("@f32", "@st32"):
        n, ops = 0, ("ldr", "ldur", "ldp", "ld1") if what == "@f32" else ("str", "stur", "stp", "st1")
        for _, m, o in body:
            if m in ops and "[sp" not in o:
                regs = o.split("[")[0]
                n += 4 * len(re.findall(r"\bq\d+\b", regs)) + 4 * len(re.findall(r"\bv\d+\.4s\b", regs))
                n += len(re.findall(r"\bs\d+\b", regs))
        return n
    return sum(1 for _, m, _ in body if m == what)


POST = re.compile(r"\[(x\d+|sp)\],\s*(#-?(?:0x)?[0-9a-f]+|x\d+)$")
PRE = re.compile(r"\[(x\d+|sp),\s*(#-?(?:0x)?[0-9a-f]+)\]!$")


def split_writeback(mn, ops):
    """A load or store with base-register writeback as the access plus an `add` of the base.

    LLVM 16's Neoverse N2 model gives the updated base register the access's whole latency
    (6 cycles for a q load), and makes a store's updated base wait for the stored data, so a
    loop stepping its pointers with post-indexed accesses shows a loop-carried chain through the
    pointer that the cores do not have (Arm's optimization guides: the base update is done in
    parallel, in about a cycle). Splitting it keeps the access and costs the update as the
    integer add it is; both sides of a comparison get the same treatment."""
    m = POST.search(ops)
    if m:
        base, step = m.groups()
        return [(mn, ops[:m.start()] + f"[{base}]"), ("add", f"{base}, {base}, {step}")]
    m = PRE.search(ops)
    if m:
        base, step = m.groups()
        return [("add", f"{base}, {base}, {step}"), (mn, ops[:m.start()] + f"[{base}]")]
    return [(mn, ops)]


def mca_input(body, split=True):
    """The loop body as assembly llvm-mca accepts: branch targets become one label."""
    lines = [".Lloop:"]
    for _, mn, ops in body:
        if BRANCH.match(mn):
            ops = re.sub(r"[0-9a-f]+\s+<.*>$", ".Lloop", ops)
        ops = re.sub(r"\s+<.*>$", "", ops)
        for m2, o2 in (split_writeback(mn, ops) if split and mn.startswith(("ld", "st")) else [(mn, ops)]):
            lines.append(f"  {m2} {o2}".rstrip())
    return "\n".join(lines) + "\n"


def run_mca(src, mcpu, iterations, tmp):
    path = os.path.join(tmp, "loop.s")
    with open(path, "w") as f:
        f.write(src)
    cmd = [MCA, "-mtriple=aarch64", f"-mcpu={mcpu}", f"-mattr={MATTR}", f"-iterations={iterations}",
           "-bottleneck-analysis", path]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"mca.py: llvm-mca failed:\n{p.stderr}\n--- input ---\n{src}")
    return p.stdout, " ".join(cmd[:-1])


def parse_mca(out):
    g = lambda pat: re.search(pat, out, re.M)
    total = int(g(r"^Total Cycles:\s+(\d+)").group(1))
    iters = int(g(r"^Iterations:\s+(\d+)").group(1))
    rthru = float(g(r"^Block RThroughput:\s+([\d.]+)").group(1))
    # Resource names and the per-iteration pressure row.
    names = re.findall(r"^\[([\d.]+)\]\s+-\s+(\S+)", out, re.M)
    sec = out.split("Resource pressure per iteration:")[1].split("\n")
    cols = re.findall(r"\[([\d.]+)\]", sec[1])
    vals = [0.0 if v == "-" else float(v) for v in sec[2].split()]
    press = {}
    label = dict(names)
    for c, v in zip(cols, vals):
        press[label.get(c, c)] = press.get(label.get(c, c), 0.0) + v
    # Units with several copies (N2UnitL01 has two): pressure per copy.
    copies = {}
    for c, _ in names:
        copies[label[c]] = copies.get(label[c], 0) + 1
    per_copy = {k: v / copies.get(k, 1) for k, v in press.items()}
    busiest = max(per_copy, key=per_copy.get)
    b = g(r"^Cycles with backend pressure increase \[\s*([\d.]+)%")
    dep = g(r"^\s+Data Dependencies:\s+\[\s*([\d.]+)%")
    res = g(r"^\s+Resource Pressure\s+\[\s*([\d.]+)%")
    return {
        "total_cycles": total, "iterations": iters, "cycles_per_iter": total / iters,
        "block_rthroughput": rthru, "busiest": busiest, "busiest_per_iter": per_copy[busiest],
        "backend_pressure_pct": float(b.group(1)) if b else 0.0,
        "dep_pct": float(dep.group(1)) if dep else 0.0,
        "resource_pct": float(res.group(1)) if res else 0.0,
    }


def bottleneck(r):
    """A one-phrase verdict: throughput-bound on a resource, or a loop-carried latency chain."""
    if r["busiest_per_iter"] >= 0.9 * r["cycles_per_iter"]:
        return f"{r['busiest']} ({r['busiest_per_iter']:.2f}/iter)"
    return f"latency (dependency chain; busiest {r['busiest']} {r['busiest_per_iter']:.2f}/iter)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("obj")
    ap.add_argument("symbol")
    ap.add_argument("--exact", action="store_true", help="the whole demangled name (copies: name#2, ...)")
    ap.add_argument("--fn-has", help="only functions containing this mnemonic (a kernel inlined into a closure)")
    ap.add_argument("--mcpu", default="cortex-a715")
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--loop", type=int, help="index into the --list output (default: the innermost loop with most SIMD)")
    ap.add_argument("--has", help="only innermost loops containing these mnemonics (comma-separated)")
    ap.add_argument("--units", type=float)
    ap.add_argument("--count", help="mnemonic whose occurrences measure the work of one iteration")
    ap.add_argument("--per", type=float, default=1.0)
    ap.add_argument("--no-split", action="store_true", help="keep post/pre-indexed accesses whole (see split_writeback)")
    ap.add_argument("--list", action="store_true", help="list the function's loops and stop")
    ap.add_argument("--show", action="store_true", help="print the loop body given to llvm-mca")
    ap.add_argument("--mca-out", action="store_true", help="print llvm-mca's full report")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        obj = assemble_if_needed(a.obj, tmp)
        funcs = functions(obj)
        name, _ = pick_function(funcs, a.symbol, a.exact, a.fn_has)
        insns = funcs[name]
        ls = loops(insns)
        if not ls:
            sys.exit(f"mca.py: {name} has no loop")
        inner = innermost(ls)
        if a.list:
            print(name)
            for i, (s, e) in enumerate(ls):
                body = insns[s:e + 1]
                simd = sum(is_simd(m, o) for _, m, o in body)
                tag = " innermost" if (s, e) in inner else ""
                print(f"  [{i}] {insns[s][0]:#x}..{insns[e][0]:#x}: {len(body)} insns, {simd} SIMD{tag}")
            return
        if a.loop is not None:
            s, e = ls[a.loop]
        else:
            if a.has:
                want = a.has.split(",")
                inner = [l for l in inner if all(any(m == w for _, m, _ in insns[l[0]:l[1] + 1]) for w in want)]
                if not inner:
                    sys.exit(f"mca.py: no innermost loop of {name} has {a.has}")
            if a.count:
                # The loop doing the most of the work measure, the shorter on a tie (a
                # remainder loop is often as wide as the main one, and longer).
                s, e = max(inner, key=lambda l: (count(insns[l[0]:l[1] + 1], a.count), l[0] - l[1]))
            else:
                s, e = max(inner, key=lambda l: (sum(is_simd(m, o) for _, m, o in insns[l[0]:l[1] + 1]), l[1] - l[0]))
        body = insns[s:e + 1]
        src = mca_input(body, not a.no_split)
        out, cmd = run_mca(src, a.mcpu, a.iterations, tmp)
        r = parse_mca(out)
        units = a.units
        if a.count:
            units = count(body, a.count) / a.per
        r.update({"function": name, "loop": [hex(insns[s][0]), hex(insns[e][0])], "insns": len(body),
                  "units_per_iter": units, "mcpu": a.mcpu, "command": cmd,
                  "bottleneck": bottleneck(r)})
        if units:
            r["cycles_per_unit"] = r["cycles_per_iter"] / units
            r["rthroughput_per_unit"] = r["block_rthroughput"] / units
        if a.show:
            print(src)
        if a.mca_out:
            print(out)
        if a.json:
            print(json.dumps(r))
        else:
            print(f"{name}\n  loop {r['loop'][0]}..{r['loop'][1]}, {r['insns']} insns; -mcpu={a.mcpu}")
            print(f"  cycles/iter {r['cycles_per_iter']:.2f} (Block RThroughput {r['block_rthroughput']:.2f}); bottleneck: {r['bottleneck']}")
            if units:
                print(f"  {units:g} units/iter -> {r['cycles_per_unit']:.3f} cycles/unit (RThroughput {r['rthroughput_per_unit']:.3f})")


if __name__ == "__main__":
    main()
