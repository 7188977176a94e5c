#!/usr/bin/env python3
"""The one table of every side-by-side figure (issue 39), from the folder scripts/bench_all.sh
writes (default target/bench/all): one markdown row per measurement, with cpl's figure, its
peer's, their ratio, the command, the CPU and the UTC date.

    python3 scripts/bench_table.py [DIR]

Reads DIR/NAME.status (rc, start, end, load, cmd), DIR/NAME.log (each script's output),
DIR/attention.json and DIR/comm.json (`cpl bench ... --json`), DIR/session and DIR/cpuinfo (the
first processor of /proc/cpuinfo at the run; this machine's when missing). A benchmark that did
not run or failed gets a row saying so; no figure is made up. Exit code 1 when any did. Stdlib only.
"""
import json
import re
import sys
from pathlib import Path

ISA = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
# name in bench_all.sh, what it measures (for rows of a run that gave none)
BENCHES = [
    ("train-f32", "train f32 (tok/s)"),
    ("train-bf16", "train bf16 (tok/s)"),
    ("eval-f32", "eval f32 (tok/s)"),
    ("eval-bf16", "eval bf16 (tok/s)"),
    ("attention", "attention f32/bf16 fwd+bwd (ms)"),
    ("dit-256", "DiT-S/2 training, 256 tokens/image (images/s)"),
    ("dit-1024", "DiT-S/2 training, 1024 tokens/image (images/s)"),
    ("llava", "LLaVA training (tok/s)"),
    ("finetune-f32", "LoRA and full fine-tuning f32 (tok/s)"),
    ("comm", "collectives, busbw / memcpy"),
]
NUM = r"([0-9.]+|nan|inf)"


def keyvals(path):
    """`key=value` lines of `path` as a dict (empty when missing)."""
    if not path.exists():
        return {}
    return dict(l.split("=", 1) for l in path.read_text().splitlines() if "=" in l)


def cpu_line(d):
    """Vendor, model name, family/model and the ISA flags present, from DIR/cpuinfo (or a cpl
    JSON's `machine` where that is missing, or this machine's /proc/cpuinfo)."""
    src = d / "cpuinfo" if (d / "cpuinfo").exists() else Path("/proc/cpuinfo")
    info = {}
    for l in src.read_text().splitlines():
        k, _, v = l.partition(":")
        info.setdefault(k.strip(), v.strip())
    if not info.get("model name") and (d / "comm.json").exists():
        m = json.loads((d / "comm.json").read_text())["machine"]
        flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16") if m[f]] + (["amx_tile"] if m["amx"] else [])
        info = {"model name": m["cpu"], "flags": " ".join(flags)}
    flags = set(info.get("flags", "").split())
    have = [f for f in ISA if f in flags]
    lack = [f for f in ISA if f not in flags]
    fam = f", family {info['cpu family']} model {info['model']}" if "cpu family" in info else ""
    return (f"{info.get('vendor_id', '?')} {info.get('model name', '?')}{fam}: "
            f"{' '.join(have) or 'none of ' + ' '.join(ISA)}" + (f" (no {' '.join(lack)})" if have and lack else ""))


def json_after(log, prefix):
    """The JSON object printed after `prefix` on a line of `log`."""
    for l in log.splitlines():
        if l.startswith(prefix):
            return json.loads(l[len(prefix):])
    raise ValueError(f"no line starting with {prefix!r}")


def x(ratio):
    return f"**{ratio:.2f}x**"


def lm_rows(name, log, d):
    work = name.split("-")[0]
    t = json_after(log, "transformers: ")
    c = json_after(log, f"cpl bench {work}: ")
    best = c["tokens_per_sec_best"]
    return [(f"{work} {name.split('-')[1]}, {t['seq_len']} tokens (tok/s)",
             f"{best:.0f} (median {c['tokens_per_sec_median']:.0f})",
             f"transformers {t['tokens_per_sec']:.0f}", x(best / t["tokens_per_sec"]))]


def attention_rows(name, log, d):
    rows = []
    ms = lambda s: "-" if s is None else f"{s * 1e3:.1f}"
    for r in json.loads((d / "attention.json").read_text())["results"]:
        tf, tfb = r["torch_fwd_s"], r["torch_fwd_bwd_s"]
        ratio = "no PyTorch timing" if tfb is None else x(tfb / r["fwd_bwd_s"])
        if tf is not None:
            ratio += f" (fwd {tf / r['fwd_s']:.2f}x)"
        rows.append((f"attention {r['dtype']} S={r['seq']} {r['mask']}, fwd+bwd (fwd) ms",
                     f"{ms(r['fwd_bwd_s'])} ({ms(r['fwd_s'])})", f"PyTorch SDPA {ms(tfb)} ({ms(tf)})", ratio))
    return rows


def dit_rows(name, log, d):
    pat = (rf"DiT-S/2 (\d+) tokens/image, batch (\d+): cpl {NUM} images/s .*?, diffusers {NUM} images/s .*?, "
           rf"ratio {NUM}x")
    return [(f"DiT-S/2 training, {m[1]} tokens/image, batch {m[2]} (images/s)", m[3], f"diffusers {m[4]}",
             f"**{m[5]}x**") for m in re.finditer(pat, log)]


def llava_rows(name, log, d):
    pat = rf"LLaVA seq (\d+): cpl train {NUM} tok/s .*?, transformers {NUM} tok/s .*?, ratio {NUM}x"
    return [(f"LLaVA training, {m[1]} tokens with one image (tok/s)", m[2], f"transformers {m[3]}", f"**{m[4]}x**")
            for m in re.finditer(pat, log)]


def finetune_rows(name, log, d):
    pat = rf"(lora|full) dtype (\w+) seq (\d+): cpl finetune {NUM} tok/s .*?, transformers {NUM} tok/s .*?, ratio {NUM}x"
    what = {"lora": ("LoRA fine-tuning (r 16, all linear)", "transformers + PEFT"),
            "full": ("full fine-tuning", "transformers")}
    return [(f"{what[m[1]][0]} {m[2].replace('float32', 'f32').replace('bfloat16', 'bf16')}, {m[3]} tokens (tok/s)",
             m[4], f"{what[m[1]][1]} {m[5]}", f"**{m[6]}x**") for m in re.finditer(pat, log)]


def comm_rows(name, log, d):
    c = json.loads((d / "comm.json").read_text())
    mem = c["memcpy"]["touched_gbs"]
    rows = []
    for r in c["results"]:
        # Local ranks receive the root's tensor itself: broadcast's time is the synchronisation alone.
        ratio = "n/a (no copy)" if r["op"] == "broadcast" else f"**{100 * r['busbw_over_memcpy']:.0f}%**"
        rows.append((f"{r['op']}, {c['ranks']} local ranks x {c['mib']} MiB (busbw GB/s)",
                     f"{r['busbw_gbs']:.2f}", f"memcpy, 1 thread {mem:.2f}", ratio))
    return rows


PARSERS = {"train": lm_rows, "eval": lm_rows, "attention": attention_rows, "dit": dit_rows, "llava": llava_rows,
           "finetune": finetune_rows, "comm": comm_rows}


def main():
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "target/bench/all")
    session = keyvals(d / "session")
    cpu = cpu_line(d)
    print("| measurement | cpl | peer | ratio | command | CPU | date |")
    print("|---|---|---|---|---|---|---|")
    # DiT's sizes are those it ran at (--quick runs other ones), else the expected two.
    dits = sorted(d.glob("dit-*.status"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 0)
    benches = [b for b in BENCHES if not b[0].startswith("dit-")]
    at = [b[0] for b in benches].index("llava")
    benches[at:at] = ([(p.stem, f"DiT-S/2 training, {p.stem[4:]} tokens/image (images/s)") for p in dits]
                      or [b for b in BENCHES if b[0].startswith("dit-")])
    bad, loads = 0, []
    for name, label in benches:
        st = keyvals(d / f"{name}.status")
        log_path = d / f"{name}.log"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        cmd = f"`{st['cmd']}`" if "cmd" in st else "–"
        date = st.get("end", "")[:16].replace("T", " ") + " UTC" if "end" in st else "–"
        rows, why = [], None
        if not st:
            why = "not run"
        else:
            loads.append(f"{name} {st.get('load', '?').split()[0]}")
            try:
                rows = PARSERS[name.split("-")[0]](name, log, d)
            except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
                why = f"no result read ({type(e).__name__}: {e})".replace("|", "/")
            if st.get("rc") != "0":  # what it printed before failing is not shown
                rows, why = [], f"**failed** (exit {st.get('rc')}; see {log_path})"
            elif not rows and why is None:
                why = f"no result found in {log_path}"
        for r in rows:
            print("| " + " | ".join(r + (cmd, cpu, date)) + " |")
        if why:
            bad += 1
            print(f"| {label} | {why} | | | {cmd} | {cpu} | {date} |")
    print()
    if session.get("quick") == "1":
        print("**--quick run: tiny sizes, checks the plumbing only; these figures mean nothing.**")
    print(f"Session {session.get('start', '?')} to {session.get('end', '?')} (UTC), commit {session.get('commit', '?')}, "
          f"{session.get('cpus', '?')} CPUs, {session.get('python', '?')}: {session.get('versions', '?')}. Ratio: cpl's rate over the peer's "
          f"(attention: the peer's time over cpl's; collectives: busbw over one thread's memcpy). "
          f"1-minute load average before each: {', '.join(loads) or '–'}.")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
