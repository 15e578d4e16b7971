"""Corpus and tokenizer of the accuracy study v2 (benchmarks/accuracy_v2.py).

Two domains, both read from what is installed on the machine that runs the study, both
recorded (names, versions, file counts, bytes, sha256) so that a run says exactly what it
read:

* **code**: the ``.py`` files of the Python distributions installed in the running
  environment (``importlib.metadata``: torch, transformers, sympy, numpy, ...; samoyeds
  itself excluded), each at its installed version.  Held out **by package**: packages
  ranked by ``sha256("heldout:" + name)`` fill the held-out split up to its byte share, the
  rest is train.  Per-package and total byte caps keep one package from dominating and
  size the corpus (``CorpusSpec``).
* **english**: text files of pinned Debian packages' documentation (``base-files``'
  ``/usr/share/common-licenses``, ``git``'s ``/usr/share/doc/git`` release notes), with the
  packages' versions from ``dpkg-query``; held out by file (hash of the path).  Absent
  packages are skipped with a note.

Near-duplicates across the split: every line is normalised (whitespace runs collapsed, ends
stripped); a *train* line whose normalised form (at least ``min_dup_chars`` characters) also
occurs in the held-out text is removed from train, so the held-out text stays the natural text
of its files and the model never saw its non-trivial lines.  Short lines (``else:``,
``return x``) stay: the overlap left in them is measured and recorded.

The tokenizer is a byte-level BPE trained offline with ``tokenizers`` on the train split
only, saved with its sha256.  Documents are joined by the ``<|endoftext|>`` token (id 0).
Everything is deterministic for a given environment; it is cached under a key of the spec
and the package versions.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.metadata as md
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class CorpusSpec:
    max_bytes: int                    # code, train + held-out
    max_package_bytes: int            # code bytes taken from one package (files in path order)
    english_max_bytes: int
    vocab: int
    heldout_frac: float = 0.1         # of the code bytes, by package
    english_heldout_pct: int = 15     # of the english files, by path hash
    min_dup_chars: int = 24
    max_file_bytes: int = 400_000     # larger .py files (generated tables) are skipped
    exclude: Tuple[str, ...] = ("samoyeds",)
    english_sources: Tuple[Tuple[str, str], ...] = (("base-files", "/usr/share/common-licenses"),
                                                    ("git", "/usr/share/doc/git"))


def _u(tag: str, name: str) -> float:
    return int(hashlib.sha256(f"{tag}:{name}".encode()).hexdigest()[:12], 16) / float(1 << 48)


def _norm(line: str) -> str:
    return " ".join(line.split())


# --- code -----------------------------------------------------------------------------------------

def python_packages(spec: CorpusSpec) -> List[dict]:
    """Installed distributions with their ``.py`` files (paths and sizes; not read yet), sorted by name."""
    seen = set()
    out = []
    for d in md.distributions():
        name = (d.metadata["Name"] or "").strip()
        key = name.lower().replace("_", "-")
        if not name or key in seen or key in spec.exclude:
            continue
        seen.add(key)
        files = []
        for f in d.files or []:
            s = str(f)
            if not s.endswith(".py"):
                continue
            p = str(d.locate_file(f))
            try:
                size = os.path.getsize(p)
            except OSError:
                continue
            if 0 < size <= spec.max_file_bytes:
                files.append((s, p, size))
        if files:
            files.sort()
            out.append({"name": name, "version": d.version, "files": files})
    out.sort(key=lambda x: x["name"].lower())
    return out


def _take(files: List[tuple], cap: int) -> List[tuple]:
    got, n = [], 0
    for f in files:
        if n + f[2] > cap and got:
            break
        got.append(f)
        n += f[2]
    return got


def select_code(spec: CorpusSpec) -> Dict[str, List[dict]]:
    """{"train": [...], "heldout": [...]} packages (with the files taken), by the split rule."""
    pkgs = python_packages(spec)
    for p in pkgs:
        p["files"] = _take(p["files"], spec.max_package_bytes)
        p["bytes"] = sum(f[2] for f in p["files"])
    total = min(spec.max_bytes, sum(p["bytes"] for p in pkgs))
    want_held = spec.heldout_frac * total
    held, train = [], []
    nh = nt = 0
    for p in sorted(pkgs, key=lambda p: _u("heldout", p["name"].lower())):
        if nh < want_held and nh + p["bytes"] <= 2 * want_held:
            held.append(p)
            nh += p["bytes"]
    rest = [p for p in pkgs if p not in held]
    for p in sorted(rest, key=lambda p: _u("train", p["name"].lower())):
        if nt >= total - nh:
            break
        take = _take(p["files"], int(total - nh - nt)) if nt + p["bytes"] > total - nh else p["files"]
        train.append(dict(p, files=take, bytes=sum(f[2] for f in take)))
        nt += train[-1]["bytes"]
    return {"train": sorted(train, key=lambda p: p["name"].lower()),
            "heldout": sorted(held, key=lambda p: p["name"].lower())}


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        if path.endswith(".gz"):
            raw = gzip.decompress(raw)
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


# --- english --------------------------------------------------------------------------------------

def _dpkg_version(pkg: str) -> Optional[str]:
    try:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True, timeout=20)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def select_english(spec: CorpusSpec) -> Tuple[Dict[str, List[Tuple[str, str]]], List[dict], List[str]]:
    """({"train": [(rel, text)], "heldout": [...]}, sources used, notes)."""
    docs: List[Tuple[str, str]] = []
    used, notes = [], []
    for pkg, root in spec.english_sources:
        ver = _dpkg_version(pkg)
        if not os.path.isdir(root):
            notes.append(f"{pkg}: {root} absent, skipped")
            continue
        n = nb = 0
        for d, dirs, files in os.walk(root):
            dirs.sort()
            for f in sorted(files):
                base = f[:-3] if f.endswith(".gz") else f
                ext = os.path.splitext(base)[1]
                if ext not in ("", ".txt", ".md") or base in ("copyright",) or base.startswith("changelog"):
                    continue
                path = os.path.join(d, f)
                if os.path.islink(path):
                    continue
                text = _read_text(path)
                if not text or sum(c.isalpha() for c in text[:4000]) < 0.5 * min(len(text), 4000):
                    continue
                rel = f"{pkg}:{os.path.relpath(path, root)}"
                docs.append((rel, text))
                n += 1
                nb += len(text.encode())
        used.append({"package": pkg, "version": ver, "root": root, "files": n, "bytes": nb})
        if ver is None:
            notes.append(f"{pkg}: dpkg-query gave no version (not a Debian package here?)")
    docs.sort(key=lambda x: _u("english", x[0]))
    out: Dict[str, List[Tuple[str, str]]] = {"train": [], "heldout": []}
    n = 0
    for rel, text in docs:
        b = len(text.encode())
        if n + b > spec.english_max_bytes and n:
            continue
        n += b
        out["heldout" if _u("english-heldout", rel) * 100 < spec.english_heldout_pct else "train"].append((rel, text))
    for k in out:
        out[k].sort()
    return out, used, notes


# --- dedup, hashes, tokenizer ---------------------------------------------------------------------

def dedup_train(train: List[str], held: List[str], min_chars: int) -> Tuple[List[str], dict]:
    """Removes from the train documents every line whose normalised form (>= min_chars)
    occurs in the held-out documents; returns the new train documents and statistics."""
    keys = set()
    all_held = set()
    for t in held:
        for line in t.splitlines():
            k = _norm(line)
            if k:
                all_held.add(k)
                if len(k) >= min_chars:
                    keys.add(k)
    out, removed_lines, removed_bytes, train_lines = [], 0, 0, set()
    for t in train:
        kept = []
        for line in t.splitlines(keepends=True):
            k = _norm(line)
            if len(k) >= min_chars and k in keys:
                removed_lines += 1
                removed_bytes += len(line.encode())
                continue
            kept.append(line)
            if k:
                train_lines.add(k)
        out.append("".join(kept))
    held_bytes = overlap_bytes = 0
    for t in held:
        for line in t.splitlines(keepends=True):
            b = len(line.encode())
            held_bytes += b
            if _norm(line) in train_lines:
                overlap_bytes += b
    return out, {"removed_train_lines": removed_lines, "removed_train_bytes": removed_bytes,
                 "min_dup_chars": min_chars,
                 "heldout_bytes_in_lines_also_in_train_after": overlap_bytes / max(1, held_bytes),
                 "note": "what overlap remains is in lines shorter than min_dup_chars (normalised)"}


def sha256_docs(docs: List[str]) -> str:
    h = hashlib.sha256()
    for t in docs:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()


def train_tokenizer(docs: List[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def token_bytes(tok) -> np.ndarray:
    """Bytes of text each token id stands for (byte-level alphabet: one character per byte;
    the document separator counts as one byte)."""
    n = tok.get_vocab_size()
    out = np.ones(n, dtype=np.int32)
    for t, i in tok.get_vocab().items():
        out[i] = 1 if t == EOS else len(t)
    return out


def encode(tok, docs: List[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    parts = []
    for i in range(0, len(docs), 256):
        for e in tok.encode_batch(docs[i:i + 256]):
            parts.append(np.asarray(e.ids, dtype=np.uint16))
            parts.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


@dataclass
class Corpus:
    tokens: Dict[str, np.ndarray]           # code_train, code_heldout, english_train, english_heldout
    token_bytes: np.ndarray
    info: dict
    tokenizer_path: str
    vocab: int = 0
    notes: List[str] = field(default_factory=list)


def _key(spec: CorpusSpec, code: Dict[str, List[dict]]) -> str:
    h = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode())
    for split in ("train", "heldout"):
        for p in code[split]:
            h.update(f"{split}:{p['name']}=={p['version']}:{len(p['files'])}:{p['bytes']}".encode())
    return h.hexdigest()[:16]


def build(cache: str, spec: CorpusSpec, log: Callable[[str], None] = print) -> Corpus:
    """Builds (or loads from ``cache``) the tokenised corpus and its tokenizer."""
    t0 = time.time()
    code = select_code(spec)
    key = _key(spec, code)
    d = os.path.join(cache, f"data-{key}")
    names = ("code_train", "code_heldout", "english_train", "english_heldout")
    if os.path.exists(os.path.join(d, "info.json")):
        with open(os.path.join(d, "info.json")) as fh:
            info = json.load(fh)
        toks = {n: np.load(os.path.join(d, f"{n}.npy")) for n in names}
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        log(f"corpus: cached {d}")
        return Corpus(toks, token_bytes(tok), info, os.path.join(d, "tokenizer.json"), tok.get_vocab_size())
    texts: Dict[str, List[str]] = {}
    pk_info: Dict[str, List[dict]] = {}
    for split in ("train", "heldout"):
        docs, rows = [], []
        for p in code[split]:
            got = [t for t in (_read_text(f[1]) for f in p["files"]) if t]
            docs += got
            rows.append({"name": p["name"], "version": p["version"], "files": len(got),
                         "bytes": sum(len(t.encode()) for t in got), "sha256": sha256_docs(got)})
        texts[f"code_{split}"] = docs
        pk_info[split] = rows
    eng, eng_used, notes = select_english(spec)
    texts["english_train"] = [t for _, t in eng["train"]]
    texts["english_heldout"] = [t for _, t in eng["heldout"]]
    held_all = texts["code_heldout"] + texts["english_heldout"]
    texts["code_train"], dd_code = dedup_train(texts["code_train"], held_all, spec.min_dup_chars)
    texts["english_train"], dd_en = dedup_train(texts["english_train"], held_all, spec.min_dup_chars)
    log(f"corpus: read {sum(len(t) for t in texts['code_train']) / 1e6:.1f} + "
        f"{sum(len(t) for t in texts['code_heldout']) / 1e6:.1f} MB of code, "
        f"{sum(len(t) for v in eng.values() for _, t in v) / 1e6:.2f} MB english ({time.time() - t0:.0f} s)")
    t1 = time.time()
    tok = train_tokenizer(texts["code_train"] + texts["english_train"], spec.vocab)
    os.makedirs(d, exist_ok=True)
    tok_path = os.path.join(d, "tokenizer.json")
    tok.save(tok_path)
    with open(tok_path, "rb") as fh:
        tok_sha = hashlib.sha256(fh.read()).hexdigest()
    log(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens, trained in {time.time() - t1:.0f} s")
    toks = {n: encode(tok, texts[n]) for n in names}
    tb = token_bytes(tok)
    info = {
        "key": key, "spec": asdict(spec),
        "code": {"source": "the .py files of the Python distributions installed in the running environment",
                 "split_rule": "packages ranked by sha256('heldout:' + name) fill the held-out split up to "
                               f"{spec.heldout_frac:.0%} of the bytes; the rest (ranked by sha256('train:' + name)) is "
                               "train up to the byte cap",
                 "train_packages": pk_info["train"], "heldout_packages": pk_info["heldout"],
                 "dedup": dd_code},
        "english": {"sources": eng_used, "notes": notes,
                    "split_rule": f"sha256('english-heldout:' + package:path) < {spec.english_heldout_pct}%",
                    "train_files": len(eng["train"]), "heldout_files": len(eng["heldout"]), "dedup": dd_en},
        "sha256": {n: sha256_docs(texts[n]) for n in names},
        "bytes": {n: int(sum(len(t.encode()) for t in texts[n])) for n in names},
        "tokens": {n: int(toks[n].size) for n in names},
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "tokenizers": _version("tokenizers"),
                      "vocab": tok.get_vocab_size(), "sha256": tok_sha, "trained_on": "code_train + english_train"},
    }
    for n in names:
        np.save(os.path.join(d, f"{n}.npy"), toks[n])
    with open(os.path.join(d, "info.json"), "w") as fh:
        json.dump(info, fh, indent=1)
    log(f"corpus: {info['tokens']} tokens ({time.time() - t0:.0f} s), cached in {d}")
    return Corpus(toks, tb, info, tok_path, tok.get_vocab_size(), notes)


def _version(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
