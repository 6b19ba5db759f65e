"""Files we read back (issue 74 items 1, 5, 6, 9): slot files and prompt-cache entries, truncated, damaged,
of another model, or with something planted where they are written, as users reach them: the installed
package's serve and chat in fresh processes. Each is refused with its reason, and the process goes on."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import http_json, model_path
from test_features_as_installed import installed_server
from test_rpc_as_installed import installed

MODEL = "qwen2moe-60x4"
GREEDY = {"n_predict": 8, "temperature": 0}
FIRST = {"prompt": "Once upon a time there was a little cat who lived in a house", **GREEDY}


def _damaged(good: bytes) -> dict:
    """name -> bytes: the file cut at several lengths, and one with 8 KiB of its state zeroed."""
    cuts = {f"cut{n}.bin": good[:n] for n in (0, 12, 96, 1000, len(good) // 2, len(good) - 1)}
    mid = len(good) // 2
    cuts["zeroed.bin"] = good[:mid] + bytes(8192) + good[mid + 8192:]
    return cuts


@pytest.mark.parametrize("np_", ["1", "2"])
def test_truncated_or_damaged_slot_files_are_refused_and_the_server_goes_on(fixture_dir, tmp_path, np_):
    """Item 1: a truncated slot file aborted a -np 2 server (GGML_ASSERT in llama-context.cpp); a file with
    8 KiB zeroed was accepted (both -np 1 and 2). Now each is a 400 naming why, and the good file still
    restores and continues as before."""
    m = model_path(fixture_dir, MODEL)
    slots = tmp_path / "slots"
    # (-np 2: the OpenAI route, which the batch serves; /completion runs alone, outside the slots)
    route, first = ("/completion", FIRST) if np_ == "1" else \
        ("/v1/completions", {"prompt": FIRST["prompt"], "max_tokens": 8, "temperature": 0})
    text = (lambda r: r["content"]) if np_ == "1" else (lambda r: r["choices"][0]["text"])
    with installed_server(tmp_path, m, "--routing", "lru", "-np", np_, "-c", "512", "--slot-save-path", slots) as base:
        _, a = http_json(base + route, first)
        status, saved = http_json(base + "/slots/0?action=save", {"filename": "s0.bin"})
        assert status == 200 and saved["n_saved"] > 8, saved
        good = (slots / "s0.bin").read_bytes()
        for name, data in _damaged(good).items():
            (slots / name).write_bytes(data)
            status, r = http_json(base + f"/slots/{int(np_) - 1}?action=restore", {"filename": name})
            assert status == 400, (name, status, r)
            why = r["error"]["message"]
            assert ("checksum" in why if name == "zeroed.bin" else
                    "truncated" in why or "not a pymoecache state file" in why), (name, why)
            assert http_json(base + "/health")[0] == 200
        status, r = http_json(base + "/slots/0?action=restore", {"filename": "s0.bin"})
        assert status == 200 and r["n_restored"] == saved["n_saved"], r
        _, again = http_json(base + route, first)
        assert text(again) == text(a)


def test_a_slot_file_of_another_model_or_context_or_kind_is_refused(fixture_dir, tmp_path):
    """Item 5: a -np 2 server restored another model's slot file (200, and its answers changed). The other
    model here is the same one quantized to Q8_0: same architecture, vocabulary and KV shapes, which
    llama.cpp's own loader accepts."""
    slots = tmp_path / "slots"
    batched = {"prompt": FIRST["prompt"], "max_tokens": 8, "temperature": 0}  # (the OpenAI route: the batch's slots)
    args = ("--routing", "lru", "-np", "2", "-c", "512", "--slot-save-path", slots)
    with installed_server(tmp_path, model_path(fixture_dir, MODEL, ".Q8_0"), *args) as base:
        http_json(base + "/v1/completions", batched)
        status, r = http_json(base + "/slots/0?action=save", {"filename": "q8.bin"})
        assert status == 200 and r["n_saved"] > 8, r
    with installed_server(tmp_path, model_path(fixture_dir, MODEL), "--routing", "lru", "-np", "2", "-c", "1024",
                          "--slot-save-path", slots) as base:
        http_json(base + "/v1/completions", batched)
        status, r = http_json(base + "/slots/0?action=save", {"filename": "c1024.bin"})
        assert status == 200 and r["n_saved"] > 8, r
    with installed_server(tmp_path, model_path(fixture_dir, MODEL), "--routing", "lru", "-np", "1", "-c", "512",
                          "--slot-save-path", slots) as base:
        http_json(base + "/completion", FIRST)
        assert http_json(base + "/slots/0?action=save", {"filename": "np1.bin"})[0] == 200
    with installed_server(tmp_path, model_path(fixture_dir, MODEL), *args) as base:
        _, alone = http_json(base + "/v1/completions", batched)
        for name, words in (("q8.bin", "another model"), ("c1024.bin", "context of 1024 tokens"),
                            ("np1.bin", "a whole context")):
            status, r = http_json(base + "/slots/1?action=restore", {"filename": name})
            assert status == 400 and words in r["error"]["message"], (name, r)
        _, after = http_json(base + "/v1/completions", batched)
        assert after["choices"][0]["text"] == alone["choices"][0]["text"]


def test_what_is_planted_at_a_slot_file_or_its_temporary_is_not_followed(fixture_dir, tmp_path):
    """Item 6: a FIFO at NAME.tmp hung the save and every later request; a link there wrote outside the
    slot directory; a directory there was a 500. Item 9: an empty slot's file is restored by its own
    restore; names with lone surrogates or of 252-255 bytes are 400s, not 500s."""
    slots = tmp_path / "slots"
    slots.mkdir()
    outside = tmp_path / "outside.bin"
    os.mkfifo(slots / "s.bin.tmp")
    os.symlink(outside, slots / "l.bin.tmp")
    (slots / "d.bin.tmp").mkdir()
    os.mkfifo(slots / "fifo.bin")
    (slots / "dir.bin").mkdir()
    with installed_server(tmp_path, model_path(fixture_dir, MODEL), "--routing", "lru", "-np", "2",
                          "--slot-save-path", slots) as base:
        status, r = http_json(base + "/slots/1?action=save", {"filename": "empty.bin"})  # (slot 1 holds nothing)
        assert status == 200 and r["n_saved"] == 0, r
        status, r = http_json(base + "/slots/1?action=restore", {"filename": "empty.bin"})
        assert status == 200 and r["n_restored"] == 0, r
        http_json(base + "/completion", FIRST)
        for name in ("s.bin", "l.bin", "d.bin"):
            status, r = http_json(base + "/slots/0?action=save", {"filename": name})
            assert status == 200 and (slots / name).is_file(), (name, r)
        assert not outside.exists() and (slots / "s.bin.tmp").exists()
        for name in ("fifo.bin", "dir.bin"):
            for action in ("save", "restore"):
                status, r = http_json(base + f"/slots/0?action={action}", {"filename": name})
                assert status == 400 and "not a regular file" in r["error"]["message"], (name, action, r)
        for name in ("\ud800.bin", "x" * 252, "y" * 255):
            raw = json.dumps({"filename": name}).encode()  # (json.dumps writes the lone surrogate as \ud800)
            status, r = http_json(base + "/slots/0?action=save", json.loads(raw))
            assert status == 400 and "not a plain file name" in r["error"]["message"], (name[:8], r)
        assert http_json(base + "/health")[0] == 200
    os.chmod(slots, 0o555)
    try:
        if os.access(slots, os.W_OK):
            return  # (root writes anyway: the read-only case cannot be made here)
        with installed_server(tmp_path, model_path(fixture_dir, MODEL), "--slot-save-path", slots) as base:
            status, r = http_json(base + "/slots/0?action=save", {"filename": "ro.bin"})
            assert status == 400 and "cannot write" in r["error"]["message"], r
    finally:
        os.chmod(slots, 0o755)


def test_a_damaged_or_foreign_prompt_cache_entry_is_not_restored(fixture_dir, tmp_path):
    """Items 1 and 5 on the prompt cache: an entry cut short aborted chat (rc 134); an entry of another model
    changed the answer. Now chat answers as with no cache, and the damaged entry is dropped."""
    m = model_path(fixture_dir, MODEL)
    store = tmp_path / "prompts"
    system = "You are a helpful assistant who answers every question about cats in one short sentence."

    def chat(model, *extra):
        r = installed(tmp_path, "chat", model, *extra, "-sys", system, "-p", "Hi", "-st", "-n", "6", "--temp", "0",
                      "--routing", "lru")
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split("> Hi", 1)[-1].strip().splitlines()[0]

    plain = chat(m)
    chat(model_path(fixture_dir, MODEL, ".Q8_0"), "--prompt-cache-dir", store)  # another model's entries
    foreign = sorted(store.glob("*.prompt"))
    assert foreign
    assert chat(m, "--prompt-cache-dir", store) == plain
    assert set(foreign) <= set(store.glob("*.prompt"))  # (another model's entries stay, unused)
    ours = sorted(set(store.glob("*.prompt")) - set(foreign))
    assert ours
    for p in foreign:
        p.unlink()
    for p in ours:
        data = p.read_bytes()
        p.write_bytes(data[:len(data) // 2])
    assert chat(m, "--prompt-cache-dir", store) == plain
    for p in ours:  # (the cut entry was dropped; the one written after is whole)
        assert not p.exists() or p.stat().st_size > len(data) // 2


def test_a_prompt_cache_that_cannot_be_written_or_named_says_so(fixture_dir, tmp_path):
    """Item 9: a read-only cache directory printed a traceback after every answer; ``--prompt-cache-dir ''``
    used the current directory; item 11: NUL or bytes paths were ValueError/TypeError."""
    m = model_path(fixture_dir, MODEL)
    r = installed(tmp_path, "chat", m, "--prompt-cache-dir", "", "-p", "Hi", "-st", "-n", "2")
    assert r.returncode == 2 and "prompt cache directory" in r.stderr, r.stderr
    assert not list(tmp_path.glob("*.prompt"))
    store = tmp_path / "ro"
    store.mkdir()
    os.chmod(store, 0o555)
    try:
        r = installed(tmp_path, "chat", m, "--prompt-cache-dir", store, "-p", "Hi", "-st", "-n", "2")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    finally:
        os.chmod(store, 0o755)
    code = ("from pymoecache.prompt_cache import PromptCache\nfrom pymoecache.errors import ConfigError\n"
            "for bad in ('a\\0b', b'dir', 5):\n    try:\n        PromptCache(bad)\n    except ConfigError as e:\n"
            "        print('refused', e)\n")
    import subprocess
    import sys

    from test_rpc_as_installed import installed_env

    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=installed_env(), capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count("refused") == 3, (r.stdout, r.stderr)
    shutil.rmtree(store)


def test_profiles_and_cache_states_name_the_model_by_its_content(fixture_dir, tmp_path):
    """The rule for every file read back, on usage profiles and cache states: they named the model by its
    description and shape only, so a same-shape model of other weights (a fine-tune, here every F16 weight's last
    mantissa bit flipped) loaded another's. Now they carry its content fingerprint: refused, while a copy of the
    same file elsewhere still loads them."""
    import numpy as np

    from test_batch import run_script

    from pymoecache.model_info import _Header

    m = model_path(fixture_dir, MODEL)
    copy, other = tmp_path / "copy.gguf", tmp_path / "other.gguf"
    shutil.copy(m, copy)
    data = np.fromfile(m, dtype=np.uint8)
    start = _Header(m).data_start
    data[start::2] ^= 1  # (the low byte of each F16: its mantissa's last bit)
    data.tofile(other)
    out = run_script(tmp_path, f"""
        import json
        from pymoecache import Llama
        from pymoecache.errors import StateFileError
        said = {{}}
        a = Llama({str(m)!r}, verbose=False)
        a("Once upon a time", max_tokens=4)
        a.save_profile("p.moeprofile")
        a.save_cache_state("s.moestate")
        a.close()
        for name, path in (("copy", {str(copy)!r}), ("other", {str(other)!r})):
            llm = Llama(path, verbose=False)
            for what, load in (("profile", llm.load_profile), ("state", llm.load_cache_state)):
                try:
                    load("p.moeprofile" if what == "profile" else "s.moestate")
                    said[name + " " + what] = "loaded"
                except StateFileError as e:
                    said[name + " " + what] = "refused: " + str(e)
            llm.close()
        print(json.dumps(said))
    """)
    assert out["copy profile"] == "loaded" and out["copy state"] == "loaded", out
    assert "another model" in out["other profile"] and "another model" in out["other state"], out
