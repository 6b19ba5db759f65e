"""The command line's parser: argparse with one-line errors, a guess only where it is one, no option taken by a prefix
of its name or with its value run on (as llama.cpp), and llama.cpp's LLAMA_ARG_* environment variables as the
defaults of the options we share. Also the types of llama.cpp's option values (-ngl's all/auto, on/off/auto, KV cache types, -ts shares). A leaf
module: it imports no command.
"""

from __future__ import annotations

import argparse
import os

EXIT_USAGE = 2
EXIT_INTERNAL = 1


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (usage stays in --help) and a "did you mean" for an unknown
    option; subcommands inherit it. As llama.cpp, no option is taken by a prefix of its name
    (``--prio`` is not ``--prior``), and a subcommand reports its own unknown options: the guess is
    one of its options, and the error points at its own --help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _get_option_tuples(self, option_string):
        # no option by a prefix of its name, and no option with its value run on, as llama.cpp: "-ctk q8_0" was
        # "-c tk", "-u 7" was "-ub 7", "-hf_" was -h (help, exit 0); an option we do not have is refused by its name
        return []

    def parse_known_args(self, args=None, namespace=None):
        if self._is_subcommand():
            self._defaults_from_environment()
        ns, extras = super().parse_known_args(args, namespace)
        if extras and self._is_subcommand():
            self.error("unrecognized arguments: " + " ".join(extras))
        return ns, extras

    def _defaults_from_environment(self) -> None:
        """llama.cpp's LLAMA_ARG_* environment variables, for the options we share: each sets its option's
        default (the command line wins); a flag's is on for 1, true, on or enabled."""
        for action in self._actions:
            for opt in action.option_strings:
                value = os.environ.get(LLAMA_ENV.get(opt, ""))
                if value is None:
                    continue
                if action.nargs == 0:  # (store_true / store_false)
                    on = value.strip().lower() in ("1", "true", "on", "enabled")
                    action.default = on if isinstance(action.const, bool) and action.const else not on
                else:
                    action.default = value  # (a string default goes through the option's type, as typed)

    def _is_subcommand(self) -> bool:
        return " " in self.prog  # "pymoecache run": made by add_subparsers

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}{self._did_you_mean(message)} (see {self.prog} --help)\n")

    def _did_you_mean(self, message: str) -> str:
        """A guess only where it is one: a name users bring from llama.cpp or the OpenAI API that this
        command spells otherwise, or a typo close to one of the command's own options (difflib ratio
        >= 0.75: --predict was offered --predictor, --temperature --chat-template); llama.cpp's samplers
        that are not here are said to be so; nothing rather than a wrong guess."""
        import difflib

        if not message.startswith("unrecognized arguments: "):
            return ""
        known = [o for a in self._actions for o in a.option_strings]  # this command's own options
        for word in message[len("unrecognized arguments: "):].split():
            if word.startswith("-"):
                name = word.split("=", 1)[0]
                if ALIASES.get(name) in known:
                    return f"; did you mean {ALIASES[name]}?"
                if name in ELSEWHERE:
                    return f"; {name} is an option of pymoecache {ELSEWHERE[name]}"
                if name in LLAMA_SAMPLERS_NOT_HERE:
                    return (f"; llama.cpp's {name} is not available here (sampling: --temp, --top-k, --top-p, --min-p, "
                            "--repeat-penalty, --presence-penalty, --frequency-penalty, --grammar)")
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.75) if len(name) > 3 else []
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


# names users bring (llama.cpp's other spellings, the OpenAI API's) -> this CLI's
ALIASES = {"--max-tokens": "-n", "--max_tokens": "-n", "--n-ctx": "--ctx-size",
           "--ctx": "--ctx-size", "--context": "--ctx-size", "--n-threads": "--threads", "--gpu-layers": "-ngl",
           "--top_k": "--top-k", "--top_p": "--top-p", "--min_p": "--min-p", "--stop": "--reverse-prompt",
           "--system": "--system-prompt"}
# llama.cpp's options another command of ours takes: said so, never guessed at (--kv-unified was "--unified?")
ELSEWHERE = {"--kv-unified": "serve", "-kvu": "serve", "--threads-http": "serve", "--slot-save-path": "serve",
             "--api-key": "serve", "--host": "serve", "--port": "serve", "-np": "serve and bench",
             "--parallel": "serve and bench"}
# llama.cpp's environment variables of the options we share (a default each; the command line wins)
LLAMA_ENV = {"--model": "LLAMA_ARG_MODEL", "--ctx-size": "LLAMA_ARG_CTX_SIZE", "--threads": "LLAMA_ARG_THREADS",
             "--threads-batch": "LLAMA_ARG_THREADS_BATCH", "--batch-size": "LLAMA_ARG_BATCH",
             "--ubatch-size": "LLAMA_ARG_UBATCH", "--flash-attn": "LLAMA_ARG_FLASH_ATTN",
             "--n-gpu-layers": "LLAMA_ARG_N_GPU_LAYERS", "--n-predict": "LLAMA_ARG_N_PREDICT",
             "--parallel": "LLAMA_ARG_N_PARALLEL", "--host": "LLAMA_ARG_HOST", "--port": "LLAMA_ARG_PORT",
             "--api-key": "LLAMA_ARG_API_KEY", "--alias": "LLAMA_ARG_ALIAS", "--cache-type-k": "LLAMA_ARG_CACHE_TYPE_K",
             "--cache-type-v": "LLAMA_ARG_CACHE_TYPE_V", "--no-mmap": "LLAMA_ARG_NO_MMAP", "--mlock": "LLAMA_ARG_MLOCK",
             "--rpc": "LLAMA_ARG_RPC", "--chat-template": "LLAMA_ARG_CHAT_TEMPLATE",
             "--chat-template-file": "LLAMA_ARG_CHAT_TEMPLATE_FILE", "--slot-save-path": "LLAMA_ARG_SLOT_SAVE_PATH",
             "--kv-unified": "LLAMA_ARG_KV_UNIFIED", "--cont-batching": "LLAMA_ARG_CONT_BATCHING",
             "--no-kv-offload": "LLAMA_ARG_NO_KV_OFFLOAD", "--split-mode": "LLAMA_ARG_SPLIT_MODE",
             "--tensor-split": "LLAMA_ARG_TENSOR_SPLIT", "--main-gpu": "LLAMA_ARG_MAIN_GPU",
             "--cpu-moe": "LLAMA_ARG_CPU_MOE", "--n-cpu-moe": "LLAMA_ARG_N_CPU_MOE", "--hf-repo": "LLAMA_ARG_HF_REPO",
             "--hf-file": "LLAMA_ARG_HF_FILE", "--fit": "LLAMA_ARG_FIT", "--seed": "LLAMA_ARG_SEED"}
# llama.cpp's samplers this runtime does not offer
LLAMA_SAMPLERS_NOT_HERE = frozenset({
    "--mirostat", "--mirostat-lr", "--mirostat-ent", "--typical", "--typical-p", "--dynatemp-range", "--dynatemp-exp",
    "--xtc-probability", "--xtc-threshold", "--dry-multiplier", "--dry-base", "--dry-allowed-length",
    "--dry-penalty-last-n", "--dry-sequence-breaker", "--top-nsigma", "--samplers", "--sampling-seq",
    "--logit-bias", "-l"})


def _number_or(value: str, words: dict, what: str):
    """An integer, or one of ``words`` (each mapped to what it means); ArgumentTypeError naming ``what``."""
    v = value.strip().lower()
    if v in words:
        return words[v]
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None


def vram_size(value: str):
    """--vram-size: experts per layer, or ``auto``."""
    return _number_or(value, {"auto": "auto"}, "a number of experts per layer or auto")


def gpu_layers(value: str):
    """-ngl as llama.cpp takes it: a number, ``all`` (-1: every layer) or ``auto`` (the layers whose
    dense part fits in the GPUs' free memory, none without a GPU: pymoecache.Llama resolves it)."""
    return _number_or(value, {"all": -1, "auto": "auto"}, "a number of layers, all or auto")


# llama.cpp's KV cache types (-ctk/-ctv): name -> ggml type
KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}


def kv_cache_type(value: str) -> str:
    """-ctk/-ctv: one of llama.cpp's KV cache types (its names, any case)."""
    v = value.strip().lower()
    if v not in KV_CACHE_TYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(KV_CACHE_TYPES)}, got {value!r}")
    return v


def _tensor_split(value: str) -> list:
    """-ts: comma- or slash-separated non-negative shares, as llama.cpp's."""
    try:
        parts = [float(x) for x in value.replace("/", ",").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected shares such as 3,1, got {value!r}") from None
    if not parts or any(not (x >= 0) or x == float("inf") for x in parts) or not any(parts):
        raise argparse.ArgumentTypeError(f"expected non-negative shares, not all 0, such as 3,1, got {value!r}")
    return parts


def on_off(value: str) -> str:
    """llama.cpp's on/off values (on, enabled, true, 1 / off, disabled, false, 0)."""
    v = value.strip().lower()
    if v not in ("on", "enabled", "true", "1", "off", "disabled", "false", "0"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return on_off_auto(v)


def on_off_auto(value: str) -> str:
    """llama.cpp's on/off/auto values (on, enabled, true, 1 / off, disabled, false, 0 / auto, -1)."""
    v = value.strip().lower()
    if v in ("on", "enabled", "true", "1"):
        return "on"
    if v in ("off", "disabled", "false", "0"):
        return "off"
    if v in ("auto", "-1"):
        return "auto"
    raise argparse.ArgumentTypeError(f"expected on, off or auto, got {value!r}")
