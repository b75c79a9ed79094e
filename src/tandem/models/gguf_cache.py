"""A disk cache of what a GGUF file takes seconds to give: its config, its converted tokenizer and
its dequantized weights, so that a second start (and every worker after the first) reads them.

    <root>/gguf/<file stem>-<key>/
        config.json                   read_gguf_config's dict
        tokenizer/                    the fast tokenizer, as save_pretrained writes it
        model.<dtype>.safetensors     the parameters of the decoder once loaded (q/k/v and
                                      gate/up packed, in the model's dtype), a tied weight once
        model.<dtype>.tp<N>-rank<r>.safetensors    the same for rank r of a tensor-parallel
                                      group of N: that rank's shard only

root: $TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem. key: a hash of the
cache's format version, the file's resolved path, size and modification time, and the versions of
the packages that convert it (gguf, transformers); a change to any of them makes a new entry.

Invariants:
* An artifact appears whole or not at all (written under a temporary name, then renamed), so a
  file mapped from the cache stays whole; one that does not load is logged and rebuilt.
* One process builds an artifact while the others wait on its own lock file, then read it.
* The cache gives exactly what the uncached path gives: the same config dict, a tokenizer with
  the same vocabulary, rules and chat template, the bytes of the same parameters (a cached file
  whose tensors are not the model's parameters counts as damaged).
* The cache only saves time: where it cannot be written, the artifact is built and used as is,
  and a warning says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tandem.models import gguf_loader

if TYPE_CHECKING:  # torch loads where weights do, not in an API process that wants a tokenizer
    import torch
    from transformers import PreTrainedTokenizerFast

    from tandem.models.base import CausalLM

logger = logging.getLogger(__name__)

# Bump when an artifact's content or layout changes: old entries are then never read.
CACHE_FORMAT_VERSION = 1
CONVERTER_PACKAGES = ("gguf", "transformers")
CACHE_DIR_ENV = "TANDEM_CACHE_DIR"

T = TypeVar("T")
# a torch dtype's name -> its name in a safetensors header
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def default_cache_root() -> Path:
    """$TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    if root := os.environ.get(CACHE_DIR_ENV):
        return Path(root).expanduser()
    if xdg_cache := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg_cache).expanduser() / "tandem"
    return Path.home() / ".cache" / "tandem"


class GGUFCache:
    """The cached config, tokenizer and weights of GGUF files, under `root`."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_root()

    def entry(self, gguf_path: str | os.PathLike) -> Path:
        """The directory of this file's artifacts (it may not exist yet)."""
        path = Path(gguf_path).resolve()
        stat = path.stat()
        identity = [CACHE_FORMAT_VERSION, str(path), stat.st_size, stat.st_mtime_ns]
        identity += [importlib.metadata.version(package) for package in CONVERTER_PACKAGES]
        key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
        return self.root / "gguf" / f"{path.stem}-{key}"

    def config(self, gguf_path: str | os.PathLike) -> dict[str, Any]:
        """read_gguf_config(gguf_path), from the cache when it holds it."""

        def write(config: dict[str, Any], target: Path) -> None:
            _write_atomically(target, lambda temporary: temporary.write_text(json.dumps(config)))

        return self._get(
            gguf_path,
            "config.json",
            "config",
            lambda target: _load_config(target),
            lambda: gguf_loader.read_gguf_config(gguf_path),
            write,
        )

    def tokenizer(self, gguf_path: str | os.PathLike) -> PreTrainedTokenizerFast:
        """load_gguf_tokenizer(gguf_path), from the cache when it holds it."""
        return self._get(
            gguf_path,
            "tokenizer",
            "tokenizer",
            _load_tokenizer,
            lambda: gguf_loader.load_gguf_tokenizer(gguf_path),
            _write_tokenizer,
        )

    def load_weights(self, model: CausalLM, gguf_path: str | os.PathLike) -> None:
        """Fill `model`'s parameters with the GGUF file's weights, as
        `model.load_weights(iter_gguf_weights(gguf_path))` does. The cache holds the parameters
        themselves (packed, in the model's dtype): on the CPU they become views of the cached
        file, mapped copy-on-write, so nothing is copied and every process that maps the file
        shares its pages; on another device they are copied there."""
        import torch

        params = dict(model.named_parameters())  # a tied weight once
        dtype_name = dtype_name_of(next(iter(params.values())))
        tp = model.tp
        shard = f".tp{tp.size}-rank{tp.rank}" if tp.size > 1 else ""

        def build() -> dict[str, torch.Tensor]:
            model.load_weights(gguf_loader.iter_gguf_weights(gguf_path))
            return {name: param.detach() for name, param in params.items()}

        def write(state: dict[str, torch.Tensor], target: Path) -> None:
            from safetensors.torch import save_file

            on_cpu = {name: tensor.cpu() for name, tensor in state.items()}
            _write_atomically(target, lambda temporary: save_file(on_cpu, temporary))

        state = self._get(
            gguf_path,
            f"model.{dtype_name}{shard}.safetensors",
            "weights",
            lambda target: _map_parameters(target, params),
            build,
            write,
        )
        with torch.no_grad():
            for name, param in params.items():
                tensor = state[name]
                if tensor.data_ptr() == param.data_ptr():  # built into the model just now
                    continue
                if param.device.type == "cpu":
                    param.data = tensor
                else:
                    param.copy_(tensor)

    def _get(
        self,
        gguf_path: str | os.PathLike,
        artifact: str,
        what: str,
        load: Callable[[Path], T],
        build: Callable[[], T],
        write: Callable[[T, Path], None],
    ) -> T:
        """The artifact loaded from the cache; else built (by this process, or by another while
        this one waits on the artifact's lock), written and returned."""
        started = time.monotonic()
        try:
            entry = self.entry(gguf_path)
            target = entry / artifact
            if (cached := _try_load(load, target, what, report_damage=True)) is not None:
                _log_hit(what, started)
                return cached
            entry.mkdir(parents=True, exist_ok=True)
            lock = _exclusive_lock(entry / f"{artifact}.lock")
        except OSError as exc:
            logger.warning("the cache at %s cannot be used (%s): %s is built", self.root, exc, what)
            return build()
        with lock:
            # Another process may have built it while this one waited.
            if (cached := _try_load(load, target, what, report_damage=False)) is not None:
                _log_hit(what, started)
                return cached
            logger.info("converting the GGUF file's %s (once: the result is cached)...", what)
            value = build()
            try:
                write(value, target)
            except Exception as exc:  # a full disk, say: the value is used uncached
                logger.warning("the %s could not be cached in %s: %s", what, entry, exc)
            else:
                logger.info(
                    "%s converted in %.1f s and cached in %s",
                    what,
                    time.monotonic() - started,
                    entry,
                )
            return value


def _log_hit(what: str, started: float) -> None:
    logger.info("%s loaded from the cache in %.1f s", what, time.monotonic() - started)


def _try_load(load: Callable[[Path], T], target: Path, what: str, report_damage: bool) -> T | None:
    """The artifact at `target`, or None when it is missing or does not load (then it is to be
    rebuilt; `report_damage` logs why)."""
    if not target.exists():
        return None
    try:
        return load(target)
    except Exception as exc:  # whatever a damaged file makes its reader raise
        if report_damage:
            logger.warning(
                "the cached %s at %s does not load (%s): it is rebuilt", what, target, exc
            )
        return None


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """`write` fills a temporary file beside `target`, which is then renamed to `target`."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(descriptor)
    try:
        write(Path(temporary))
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _load_config(target: Path) -> dict[str, Any]:
    config = json.loads(target.read_text())
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError("not a model config")
    return config


def _load_tokenizer(target: Path) -> PreTrainedTokenizerFast:
    if not (target / "tokenizer.json").is_file():
        raise ValueError("tokenizer.json is missing")
    settings = json.loads((target / "tokenizer_config.json").read_text())
    # transformers' generic fast tokenizer (what it converts a GGUF file's into) loads without
    # AutoTokenizer, whose import brings torch into an API process (2 to 3 s on two cores)
    if settings.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    else:
        from transformers import AutoTokenizer as tokenizer_class
    return tokenizer_class.from_pretrained(str(target), local_files_only=True)


def _write_tokenizer(tokenizer: PreTrainedTokenizerFast, target: Path) -> None:
    """A directory cannot be renamed over another: a damaged one is moved aside and removed first
    (readers that find no directory then wait on the lock, which the writer holds)."""
    temporary = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer.save_pretrained(str(temporary))
        if target.exists():
            damaged = Path(tempfile.mkdtemp(prefix=f".{target.name}.damaged.", dir=target.parent))
            os.replace(target, damaged / target.name)
            shutil.rmtree(damaged, ignore_errors=True)
        os.replace(temporary, target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _map_parameters(target: Path, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of the safetensors file `target`, mapped copy-on-write, one per parameter of
    `params` (same name, dtype and shape). The header is read from the mapping itself and must
    describe exactly these tensors, covering the file without gaps (a truncated or damaged file is
    a ValueError)."""
    import torch

    size = target.stat().st_size
    data = torch.from_file(str(target), shared=False, size=size, dtype=torch.uint8)
    header_size = int.from_bytes(data[:8].numpy().tobytes(), "little")
    start = 8 + header_size
    if start > size:
        raise ValueError("the header runs past the end of the file")
    header = json.loads(data[8:start].numpy().tobytes())
    header.pop("__metadata__", None)
    if set(header) != set(params):
        raise ValueError("the file's tensors are not the model's parameters")
    state, extents = {}, []
    for name, param in params.items():
        entry = header[name]
        begin, end = entry["data_offsets"]
        dtype = SAFETENSORS_DTYPES.get(dtype_name_of(param))
        if entry["dtype"] != dtype or entry["shape"] != list(param.shape):
            raise ValueError(f"{name} is not a {param.dtype} tensor of shape {list(param.shape)}")
        if end - begin != param.numel() * param.element_size():
            raise ValueError(f"{name} has the wrong size")
        extents.append((begin, end))
    # One tensor after the other from the end of the header to the end of the file.
    ends = [0] + [end for _, end in sorted(extents)]
    if [begin for begin, _ in sorted(extents)] != ends[:-1] or ends[-1] != size - start:
        raise ValueError("the tensors do not cover the file")
    for name, param in params.items():
        begin, end = header[name]["data_offsets"]
        state[name] = data[start + begin : start + end].view(param.dtype).view(param.shape)
    return state


def dtype_name_of(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
