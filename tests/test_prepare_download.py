"""Downloads (offline, from a local HTTP server): resume with Range, size check, skip when
complete, clear errors; and a TED preparation that downloads its archive."""
import http.server
import json
import os
import threading

import pytest

from inprocess import forked_commands
from prepare_fixtures import make_ted_archive

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.prepare import download
from fairseq_normplug.prepare import ted as ted_cli
from fairseq_normplug.prepare.cli import run_main

PAYLOAD = bytes(range(256)) * 4000  # ~1 MB


class Server:
    """Serves ``files`` (name -> bytes) with Range support; ``cut`` truncates replies."""

    def __init__(self):
        self.files, self.requests, self.cut = {}, [], None
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append((self.path, self.headers.get("Range")))
                data = server.files.get(self.path.lstrip("/"))
                if data is None:
                    self.send_error(404)
                    return
                start = 0
                if self.headers.get("Range"):
                    start = int(self.headers["Range"].split("=")[1].rstrip("-"))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                body = data[start:]
                self.wfile.write(body[: server.cut] if server.cut is not None else body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(download.time, "sleep", lambda seconds: None)
    srv = Server()
    srv.files["data.bin"] = PAYLOAD
    yield srv
    srv.close()


def quiet(message):
    pass


def test_download_then_reuse_without_network(server, tmp_path):
    path = str(tmp_path / "data.bin")
    download.fetch(server.url + "data.bin", path, quiet)
    assert open(path, "rb").read() == PAYLOAD
    record = json.load(open(path + ".download.json"))
    assert record["size"] == len(PAYLOAD) and record["sha256"] == download.sha256_of(path)
    assert not os.path.exists(path + ".part")
    count = len(server.requests)
    download.fetch(server.url + "data.bin", path, quiet)
    assert len(server.requests) == count  # complete: no request at all
    assert download.fingerprint(path)["url"] == server.url + "data.bin"


def test_download_resumes_a_partial_file(server, tmp_path):
    path = str(tmp_path / "data.bin")
    with open(path + ".part", "wb") as f:
        f.write(PAYLOAD[:300000])
    download.fetch(server.url + "data.bin", path, quiet)
    assert server.requests == [("/data.bin", "bytes=300000-")]
    assert open(path, "rb").read() == PAYLOAD


def test_short_transfer_is_detected_then_resumed(server, tmp_path):
    path = str(tmp_path / "data.bin")
    server.cut = 1000  # every reply stops after 1000 bytes
    with pytest.raises(NormplugError, match=r"stopped at 3000 of 1024000 bytes; run again to resume"):
        download.fetch(server.url + "data.bin", path, quiet)
    assert not os.path.exists(path) and os.path.getsize(path + ".part") == 3000
    server.cut = None
    download.fetch(server.url + "data.bin", path, quiet)
    assert server.requests[-1][1] == "bytes=3000-"
    assert open(path, "rb").read() == PAYLOAD


def test_download_errors_are_clear(server, tmp_path):
    with pytest.raises(NormplugError, match="HTTP 404"):
        download.fetch(server.url + "absent.tgz", str(tmp_path / "absent.tgz"), quiet)
    with pytest.raises(NormplugError, match="cannot download http://127.0.0.1:9/x.tgz"):
        download.fetch("http://127.0.0.1:9/x.tgz", str(tmp_path / "x.tgz"), quiet)
    path = str(tmp_path / "data.bin")
    download.fetch(server.url + "data.bin", path, quiet)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(NormplugError, match="changed or truncated"):
        download.fetch(server.url + "data.bin", path, quiet)


@pytest.mark.slow
def test_prepare_ted_downloads_its_archive(server, tmp_path, monkeypatch, capsys):
    archive = make_ted_archive(str(tmp_path / "served.tar.gz"))
    server.files["ted_talks.tar.gz"] = open(archive, "rb").read()
    monkeypatch.setattr(ted_cli, "URL", server.url + "ted_talks.tar.gz")
    downloads, dest = str(tmp_path / "downloads"), str(tmp_path / "gl-en")
    argv = ["gl", "en", "--download-dir", downloads, "--dest", dest, "--bpe-merges", "50", "--workers", "1"]
    with forked_commands():  # the pipeline's fairseq-preprocess: a fork of this process
        run_main(ted_cli.PROG, ted_cli.main, argv)
    assert os.path.getsize(os.path.join(downloads, "ted_talks.tar.gz")) == os.path.getsize(archive)
    with open(os.path.join(dest, "manifest.json")) as f:
        source = json.load(f)["source"]["archive"]
    assert source["url"] == server.url + "ted_talks.tar.gz"
    assert source["sha256"] == download.sha256_of(archive)
