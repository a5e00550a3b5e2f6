"""Where a model's files are, and its tokenizer: no torch here, so that the server process can
find the tokenizer (and refuse a bad path) before it starts the engine process, without the
seconds of importing torch first.

    resolve_model_dir(path)   a Hugging Face folder for the path (a GGUF file: converted once)
    tokenizer_dir(path)       the folder with the model's config and tokenizer (a GGUF file:
                              its cached config and tokenizer only, never a conversion)
    load_tokenizer(folder)
    file_digest(file)         the SHA-256 of a weights file, hashed once per version of the file
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from radixserve.cache.disk_guard import make_dirs
from radixserve.models.gguf import ModelLoadError, cache_root, default_gguf, ensure_converted, ensure_meta, made_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# the class AutoTokenizer chose for a folder's tokenizer, remembered (cache_root()/tokenizer_classes.json,
# keyed by the folder and its tokenizer files' sizes and times): the next start imports that class
# from its own module instead of AutoTokenizer's search through every model family (Qwen2.5's
# tokenizer: 2.3 s instead of 4.7 s, in the server and the engine process each)
_CLASS_FILES = ("config.json", "tokenizer_config.json", *_TOKENIZER_FILES)
DIGESTS, MAX_DIGESTS = "file_digests.json", 256  # weight files' digests (cache_root()), by file version


def resolve_model_dir(path: str | None) -> Path:
    """A Hugging Face folder for `path` (None: the default model), converting GGUF once."""
    if path is None:
        return ensure_converted(default_gguf())
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {path!r} does not exist (expected a Hugging Face folder or a .gguf file)")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"model path {path!r} is a file but not a .gguf file")
        return ensure_converted(p)
    if not (p / "config.json").exists():
        raise ModelLoadError(f"model folder {path!r} has no config.json")
    return p


def gguf_file(path: str | None) -> Path | None:
    """The .gguf file `path` names (None: the default model's), or None for a folder."""
    if path is None:
        return default_gguf()
    p = Path(path).expanduser()
    return p if p.is_file() and p.suffix == ".gguf" else None


def weight_files(path: str | None) -> list[Path]:
    """The files a start reads the weights from (no torch here): a GGUF and its packed caches
    (models.packed_cache), or a folder's safetensors."""
    gguf = gguf_file(path)
    if gguf is None:
        return sorted(resolve_model_dir(path).glob("*.safetensors"))
    from radixserve.models.gguf import converted_dir

    out = converted_dir(gguf)
    return [gguf, *sorted(out.with_name(out.name + "-packed").glob("*.bin"))]


def prefetch(files: list[str]) -> None:
    """Ask the OS to read these files into the page cache now, in the background
    (posix_fadvise WILLNEED): the engine process does it before importing torch, so a cold
    disk's reads overlap the import. Never raises."""
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):  # AttributeError: no posix_fadvise (macOS)
            pass
        finally:
            os.close(fd)


def tokenizer_dir(path: str | None) -> Path:
    """The folder with the model's config and tokenizer: a GGUF file's (the default model's
    included) are read from it once into a cached folder, without its weights; a folder is
    itself. A bad path raises ModelLoadError."""
    gguf = gguf_file(path)
    if gguf is not None:
        return ensure_meta(gguf)
    return resolve_model_dir(path)


def load_tokenizer(folder: Path, fast: bool = False, save_fast: bool = False) -> Any:
    """The folder's transformers tokenizer; `fast`: the engine's FastTokenizer over the same
    backend, without importing transformers from the second start on (models.fast_tokenizer);
    `save_fast`: the transformers tokenizer, its fast form saved for the engine if not yet (a
    server does, while its engine process packs a new file's weights)."""
    if not any((folder / f).exists() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"model folder {folder} has no tokenizer (looked for {', '.join(_TOKENIZER_FILES)})")
    made = made_tokenizer(folder)  # a GGUF's, just written by this process
    if made is not None:
        _remember_class(_class_key(folder), f"{type(made).__module__}:{type(made).__qualname__}")
    if not fast and not save_fast:
        return made if made is not None else _load_full(folder)
    from radixserve.models import fast_tokenizer as ft

    path = ft.cache_path(cache_root(), f"{_class_key(folder)}|{_versions()}")
    if fast and made is None:
        tok = ft.load_fast(path, lambda: _load_full(folder))
        if tok is not None:
            return tok
    full = made if made is not None else _load_full(folder)
    if not hasattr(full, "backend_tokenizer"):  # a slow (Python) tokenizer: nothing to save
        return full
    try:
        if not (save_fast and path.exists()):  # (a server saves it once, for its engine)
            ft.save_fast(full, path)
    except OSError:  # a read-only cache: transformers each time
        return full
    return full if save_fast else ft.load_fast(path, lambda: full) or full


def vocab_texts(tok: Any, n: int) -> list[str]:
    """The text of each of the first `n` tokens. A fast tokenizer decodes the whole vocabulary in
    one batch (0.24 s for Qwen2.5's 151,936 tokens, 0.6 s one by one); one that cleans up spaces
    around punctuation in `decode` is decoded one by one, as it would be."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and not getattr(tok, "clean_up_tokenization_spaces", False):
        return list(backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False))
    return [tok.decode([i]) for i in range(n)]


def vocab_texts_soon(tok: Any) -> Future[list[str]]:
    """`vocab_texts` of the whole vocabulary on a thread of its own (a server's, while its engine
    process loads)."""
    out: Future[list[str]] = Future()

    def run() -> None:
        try:
            out.set_result(vocab_texts(tok, len(tok)))
        except Exception as e:  # a tokenizer that cannot decode some id: the server decodes on demand
            out.set_exception(e)

    threading.Thread(target=run, name="radixserve-vocab-texts", daemon=True).start()
    return out


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"transformers {version('transformers')} tokenizers {version('tokenizers')}"
    except PackageNotFoundError:
        return ""


def _load_full(folder: Path) -> Any:
    key = _class_key(folder)
    known = _known_classes().get(key)
    if known is not None:
        import importlib

        module, _, name = known.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # another transformers version: the general way
            cls = None
        if cls is not None:
            return cls.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    _remember_class(key, f"{type(tok).__module__}:{type(tok).__qualname__}")
    return tok


def _classes_file() -> Path:
    return cache_root() / "tokenizer_classes.json"


def _class_key(folder: Path) -> str:
    stats = []
    for name in _CLASS_FILES:
        try:
            st = (folder / name).stat()
        except OSError:
            continue
        stats.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return f"{folder.resolve()}|{'|'.join(stats)}"


def _known_classes() -> dict[str, str]:
    try:
        found = json.loads(_classes_file().read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _remember_class(key: str, where: str) -> None:
    """Written whole and renamed into place: another process reading it meanwhile sees the old
    or the new file; of two writers, one's entry may be lost (and made again next time)."""
    known = _known_classes()
    if known.get(key) == where:
        return
    known[key] = where
    path = _classes_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    except OSError:  # a read-only cache: AutoTokenizer each time
        pass


def file_digest(f: Path) -> str:
    """The SHA-256 of the whole file, computed once per version of it: remembered in the
    radixserve cache dir by (device, inode, size, mtime, ctime). Writing to a file, even to the
    same size with its mtime set back, gives it a new ctime: a file changed in place is hashed
    again."""
    st = f.stat()
    ident = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    cache = cache_root() / DIGESTS
    known = _load_digests(cache)
    if ident in known:
        return known[ident]
    digest = _hash_file(f)
    after = f.stat()
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
        known.pop(ident, None)
        known[ident] = digest
        _save_digests(cache, dict(list(known.items())[-MAX_DIGESTS:]))
    return digest


def _hash_file(f: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(f, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _load_digests(cache: Path) -> dict[str, str]:
    """The remembered digests ({} if none, or if the file is not this user's alone)."""
    try:
        fd = os.open(cache, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            return {}
        try:
            found = json.loads(fh.read(1 << 20))
        except ValueError:
            return {}
    return {k: v for k, v in found.items() if isinstance(v, str)} if isinstance(found, dict) else {}


def _save_digests(cache: Path, known: dict[str, str]) -> None:
    """Written whole (0600) and renamed into place; of two writers at once, one's entry may be
    lost (and computed again next time). A read-only cache dir: nothing remembered."""
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        make_dirs(cache.parent)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(known, fh)
        os.replace(tmp, cache)
    except OSError:
        tmp.unlink(missing_ok=True)
