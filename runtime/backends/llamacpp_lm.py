"""The llama.cpp backend: the GGUF file as it is, on llama.cpp's own quantized kernels.

Through llama-cpp-python (the optional `mirrorsd[llamacpp]` extra; it compiles llama.cpp when installed:
CPU by default, `CMAKE_ARGS="-DGGML_METAL=on"` / `"-DGGML_CUDA=on"` / `"-DGGML_VULKAN=on"` for a GPU): its
`Llama` loads the file and holds the context (`Llama.model`, `Llama.ctx`), and the passes go through llama.cpp's
C API as llama-cpp-python exposes it (`llama_batch_init`, `llama_decode`, `llama_get_logits`,
`llama_memory_seq_rm`), as llama.cpp's own speculative example drives it.
Cache reconciliation is PrefixCachedLM's: a step feeds only the tokens the KV cache lacks, in one
batch, asking llama.cpp for logits at the last k+1 positions only; rollback removes the KV cells past
the committed length (`llama_memory_seq_rm`). No early exit (llama.cpp runs the graph whole) and no
per-layer thread control: the pipeline runs "branches" as "overlap" and shares no cores.

Exactness: a verify pass must give each position the logits one-token decoding gives. Stock ggml-cpu
does not (its batched kernels -- repacked GEMM, the tiled K-quant matmul, tinyBLAS, tiled and split-KV
flash attention -- accumulate in other orders), so scripts/setup.sh builds llama.cpp with
scripts/patches/ggml-cpu-batch-invariant.patch, which adds a batch-invariant mode
(`ggml_cpu_set_batch_invariant`), and this backend turns it on for its passes, with flash attention
(the per-row attention kernel). On a build without the patch, or on a GPU, passes of any shape are not
exact (`exact_batches` False); fixed-shape passes may be:

Fixed-shape passes (`fixed_rows=P`, the `llamacpp-static` backend, and llama.cpp on a GPU): every pass, prompt
prefill included, decodes exactly P token rows and asks for all P rows' logits, real tokens first and pads after
them, whose cache cells are removed after the pass. Every kernel then sees one shape, whatever the number of
real tokens, which is what a kernel's choice of tiling and accumulation order depends on; pads sit after the
real tokens, where the causal mask keeps them out of every real row, and leave nothing behind. Whether that
makes a device's rows exact the invariance check decides (runtime/backends/__init__.py: once per model, device
and build, cached); on the CPU's stock kernels it does (docs/exactness.md).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from mirrorsd.errors import ConfigError, ModelNotFoundError
from mirrorsd.runtime.backends.base import PrefixCachedLM
from mirrorsd.runtime.backends.cpu_kernels import physical_cores
from mirrorsd.runtime.backends.ggml_kernels import batch_invariant_switch

DEFAULT_CONTEXT = 4096  # KV cells to allocate (the model's training context if smaller)
EXTRA = "llamacpp"


def import_llama_cpp():
    """llama_cpp, or a clear error naming the extra that installs it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ConfigError("the llama.cpp backend needs llama-cpp-python, which is not installed",
                          f"pip install 'mirrorsd[{EXTRA}]' (it compiles llama.cpp: several minutes), "
                          "or use --backend torch") from exc
    return llama_cpp


@contextlib.contextmanager
def model_params(**fields):
    """llama_model_params fields that llama-cpp-python's Llama() does not take, for the loads inside."""
    import llama_cpp.llama_cpp as api

    default = api.llama_model_default_params

    def params():
        p = default()
        for name, value in fields.items():
            setattr(p, name, value)
        return p

    api.llama_model_default_params = params
    try:
        yield
    finally:
        api.llama_model_default_params = default


class LlamaCppLM(PrefixCachedLM):
    """CausalLM over a llama.cpp context for one GGUF file."""

    early_exit = None
    threads = None

    def __init__(self, gguf: str | Path, n_ctx: int = DEFAULT_CONTEXT, threads: int | None = None,
                 gpu_layers: int | None = None, exact: bool = True, flash_attn: bool | None = None,
                 repack: bool = True, fixed_rows: int | None = None) -> None:
        """threads: CPU threads (default: the physical cores); gpu_layers: layers offloaded to the GPU
        (default: all where the build supports a GPU, else none); exact: ggml's batch-invariant kernels
        (False: llama.cpp's stock kernels, for comparisons); flash_attn: llama.cpp's flash attention
        (default: as exact; exactness needs it); repack: the CPU backend's repacked weight layouts
        (llama_model_params.use_extra_bufts); fixed_rows: P, every pass of exactly P rows (module docstring;
        `exact_batches` is then False until the invariance check's verdict is set)."""
        super().__init__()
        llama_cpp = import_llama_cpp()
        gguf = Path(gguf)
        if not gguf.is_file():
            raise ModelNotFoundError(f"GGUF file {str(gguf)!r} does not exist", "check the path")
        offload = bool(llama_cpp.llama_supports_gpu_offload())
        gpu_layers = (-1 if offload else 0) if gpu_layers is None else gpu_layers
        threads = threads or physical_cores()
        self._switch = batch_invariant_switch()
        self.exact, flash_attn = exact, exact if flash_attn is None else flash_attn
        try:
            with model_params(use_extra_bufts=repack):
                self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                           n_threads_batch=threads, n_gpu_layers=gpu_layers, logits_all=False,
                                           flash_attn=flash_attn, verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise ModelNotFoundError(
                f"llama.cpp could not load {gguf.name}: {exc}",
                "the file may be corrupt or of an architecture this llama.cpp build does not know; "
                "check it with `gguf-dump`, or use --backend torch") from exc
        if fixed_rows is not None and not 1 <= fixed_rows <= self.llm.n_batch:
            raise ConfigError(f"fixed_rows must be 1..{self.llm.n_batch}, got {fixed_rows}")
        self.fixed_rows = fixed_rows
        self.path = gguf
        self._api = llama_cpp
        self._batch = llama_cpp.llama_batch_init(self.llm.n_batch, 0, 1)  # tokens, no embeddings, one sequence
        self.vocab_size = int(self.llm.n_vocab())
        self.max_context = min(int(self.llm.n_ctx()), int(llama_cpp.llama_model_n_ctx_train(self.llm.model)) or n_ctx)
        self.computes_on = "gpu" if offload and gpu_layers != 0 else "cpu"
        self.n_threads = threads
        # The patch makes the CPU kernels batch-invariant; fixed rows wait for the check's verdict (the loader's).
        self.exact_batches = (fixed_rows is None and self._switch is not None and exact and flash_attn
                              and self.computes_on == "cpu")

    @property
    def backend(self) -> str:
        return f"llamacpp{'-static' if self.fixed_rows else ''}:{self.computes_on}"

    def eog_ids(self, candidates) -> frozenset[int]:
        """Which of these token ids end generation for llama.cpp (EOS, EOT, <|im_end|>, ...)."""
        vocab = self._api.llama_model_get_vocab(self.llm.model)
        return frozenset(int(t) for t in candidates if 0 <= int(t) < self.vocab_size
                         and self._api.llama_vocab_is_eog(vocab, int(t)))

    # -- CausalLM ----------------------------------------------------------------------------------

    def _feed(self, new: list[int], rows: int) -> torch.Tensor:
        """Decode `new` in batches of n_batch; logits [rows, V] for the last rows positions only."""
        api, llm, batch = self._api, self.llm, self._batch
        if self._switch is not None:
            self._switch(self.exact)  # per pass: the mode is process-wide (another Llama may run stock kernels)
        first_wanted = len(new) - rows
        out: list[np.ndarray] = []
        n_past = len(self._cached)
        fixed = self.fixed_rows
        step = fixed or llm.n_batch
        for start in range(0, len(new), step):
            if start:
                self.check_cancel()  # a long prompt stops within a chunk of its client leaving
            chunk = new[start:start + step]
            first = max(first_wanted - start, 0)  # the chunk's first row asked for
            n = fixed or len(chunk)  # rows in the pass: fixed shape, the chunk then pads (token 0) after it
            for i in range(n):  # one sequence (0); logits only for the rows asked for (fixed: every row)
                batch.token[i] = chunk[i] if i < len(chunk) else 0
                batch.pos[i], batch.n_seq_id[i], batch.logits[i] = n_past + i, 1, bool(fixed) or i >= first
                batch.seq_id[i][0] = 0
            batch.n_tokens = n
            status = api.llama_decode(llm.ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode failed ({status}) at {n_past} cached tokens, a batch of {n}")
            if first < len(chunk):
                given = n if fixed else len(chunk) - first  # logits rows llama.cpp returned, in batch order
                logits = np.ctypeslib.as_array(api.llama_get_logits(llm.ctx), shape=(given * self.vocab_size,))
                logits = logits.reshape(given, self.vocab_size)
                out.append((logits[first:len(chunk)] if fixed else logits).copy())
            n_past += len(chunk)
            self._cached.extend(chunk)
            if fixed and n > len(chunk):
                self._drop(n_past)  # the pads' cells
            llm.n_tokens = n_past  # Llama's public count, for its own generate() on this context (bench's peer)
        return torch.from_numpy(np.concatenate(out))  # [rows, V] float32

    def _drop(self, length: int) -> None:
        self._api.llama_memory_seq_rm(self._api.llama_get_memory(self.llm.ctx), -1, length, -1)
        self.llm.n_tokens = length

    def close(self) -> None:
        self.reset()
        if self._batch is not None:
            self._api.llama_batch_free(self._batch)
            self._batch = None
        self.llm.close()
