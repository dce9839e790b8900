"""A tiny synthetic corpus shared by the data tests (generated once per test run), LibriSpeech's and MUSAN's
layouts filled from it, a runner of recipes/librispeech/prepare.py, and a local stand-in for OpenSLR's server."""

import hashlib
import io
import logging
import re
import runpy
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from dataclasses import dataclass
from pathlib import Path

import pytest

from asrprec._optional import is_available

needs_espeak = pytest.mark.skipif(not is_available("espeakng_loader"), reason="needs espeakng-loader (asrprec[synth])")

TINY = dict(num_train=12, num_dev=4, num_test=4, num_test_fast=2, seed=0, shard_size=4, snr_db=(10.0, 20.0), reverb_prob=0.5)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    if not is_available("espeakng_loader"):
        pytest.skip("needs espeakng-loader (asrprec[synth])")
    from asrprec.data import generate_corpus

    out = tmp_path_factory.mktemp("corpus")
    return out, generate_corpus(out, num_workers=2, **TINY)


@pytest.fixture(scope="session")
def tiny_fbank(tiny_corpus, tmp_path_factory):
    from asrprec.data import compute_corpus_fbank

    out, cuts = tiny_corpus
    return out, compute_corpus_fbank(cuts, out, num_jobs=1)


# LibriSpeech's on-disk layout (what openslr's archives unpack to), filled with the tiny corpus' audio:
# <root>/LibriSpeech/<part>/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac and <speaker>-<chapter>.trans.txt.
# Train gets all 12 training utterances; each dev and test part two of the four dev / test ones.
LIBRISPEECH_FIXTURE_PARTS = {"train-clean-100": ("train", 0, 12), "dev-clean": ("dev", 0, 2),
                             "dev-other": ("dev", 2, 4), "test-clean": ("test", 0, 2), "test-other": ("test", 2, 4)}


def write_librispeech_layout(root, cuts_by_split):
    """Copy the tiny corpus into LibriSpeech's layout under ``root``; return ``{part: {utt_id: (text, flac path)}}``."""
    import shutil

    written = {}
    for p_idx, (part, (split, lo, hi)) in enumerate(LIBRISPEECH_FIXTURE_PARTS.items()):
        written[part] = {}
        for i, cut in enumerate(list(cuts_by_split[split])[lo:hi]):
            speaker, chapter = 100 + 10 * p_idx + i % 2, 1000 + p_idx  # two speakers, one chapter per part
            folder = root / "LibriSpeech" / part / str(speaker) / str(chapter)
            folder.mkdir(parents=True, exist_ok=True)
            utt = f"{speaker}-{chapter}-{i:04d}"
            shutil.copy(cut.recording.sources[0].source, folder / f"{utt}.flac")
            with open(folder / f"{speaker}-{chapter}.trans.txt", "a") as f:
                f.write(f"{utt} {cut.supervisions[0].text}\n")
            written[part][utt] = (cut.supervisions[0].text, folder / f"{utt}.flac")
    return written


def write_musan_layout(root, seconds=12.0, sample_rate=16000):
    """MUSAN's layout under ``root/musan``: one 16 kHz WAV per part (music with its ANNOTATIONS line), each
    ``seconds`` long: a chord (music), modulated pink noise (speech-like babble) and white noise (noise)."""
    import numpy as np
    import soundfile as sf

    from asrprec.data.augment import make_noise

    rng = np.random.default_rng(0)
    n = int(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    signals = {
        ("music", "fma", "music-fma-0000"): sum(np.sin(2 * np.pi * f * t) for f in (220.0, 277.2, 329.6)) / 3,
        ("speech", "librivox", "speech-librivox-0000"): make_noise(n, rng, color="pink") * (1 + np.sin(6 * np.pi * t)) / 2,
        ("noise", "free-sound", "noise-free-sound-0000"): make_noise(n, rng),
    }
    paths = {}
    for (part, source, name), x in signals.items():
        folder = root / "musan" / part / source
        folder.mkdir(parents=True, exist_ok=True)
        x = (0.1 * x / np.max(np.abs(x))).astype(np.float32)
        sf.write(str(folder / f"{name}.wav"), x, sample_rate, subtype="PCM_16")
        paths[part] = folder / f"{name}.wav"
    (root / "musan" / "music" / "fma" / "ANNOTATIONS").write_text("music-fma-0000 classical N synthetic\n")
    return paths


@pytest.fixture(scope="session")
def corpus_layouts(tiny_corpus, tmp_path_factory):
    """``(root, written)``: LibriSpeech and MUSAN fixtures side by side in ``root`` (as lhotse's downloaders
    leave them)."""
    _, cuts = tiny_corpus
    root = tmp_path_factory.mktemp("corpora")
    written = write_librispeech_layout(root, cuts)
    write_musan_layout(root)
    return root, written


PREPARE = Path(__file__).resolve().parents[2] / "recipes" / "librispeech" / "prepare.py"


@pytest.fixture
def prepare(monkeypatch, capsys):
    """Run prepare.py's ``__main__`` here; return how it ended (None when it finished): the exit ``code`` and the
    ``error`` line run_main wrote to stderr."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level

    def run(*args):
        monkeypatch.setattr(sys, "argv", [str(PREPARE), *map(str, args)])
        capsys.readouterr()
        try:
            runpy.run_path(str(PREPARE), run_name="__main__")
        except SystemExit as e:
            err, mark = capsys.readouterr().err, "prepare.py: error: "
            return Ended(e.code, err[err.rfind(mark):].strip() if mark in err else str(e.code))
        return None

    yield run
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


@dataclass
class Ended:
    code: object  # the SystemExit code (2 for a user error)
    error: str  # the last "prepare.py: error: ..." on stderr to the end


def tar_gz(members):
    """The bytes of a tar.gz archive holding ``{name: bytes}``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_400_000_000
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def md5_hex(data):
    return hashlib.md5(data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    """GET of ``server.files[path]`` with ``Range: bytes=N-`` support: 206 with Content-Range, 416 past the end."""

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        srv = self.server
        asked = self.headers.get("Range")
        srv.requests.append((self.path, asked))
        body = srv.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start = 0
        if asked and not srv.ignore_range:
            start = int(re.fullmatch(r"bytes=(\d+)-", asked)[1])
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        stop = srv.drops.pop(0) if srv.drops else len(body)  # a dropped connection: the body ends at ``stop``
        self.wfile.write(body[start:max(start, stop)])
        self.close_connection = True


@pytest.fixture
def openslr():
    """A local HTTP server in OpenSLR's layout: ``url`` is its ``resources`` base; put archives in ``files``
    (``{"/resources/12/dev-clean.tar.gz": bytes}``). ``requests`` records ``(path, Range header)``; each entry of
    ``drops`` ends one answer's body at that offset of the file (the connection drops); ``ignore_range`` answers
    every request with the whole file."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.files, server.requests, server.drops, server.ignore_range = {}, [], [], False
    server.url = f"http://127.0.0.1:{server.server_address[1]}/resources"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
