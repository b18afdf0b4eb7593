"""A fake PVE REST API (https on 127.0.0.1) over the same state as the fake ``pct``, for proxmoxer.

Implements what dflashctl uses: ``GET /api2/json/nodes/<node>/lxc/<id>/status/current``,
``POST .../status/start`` (returns a UPID) and ``GET /api2/json/nodes/<node>/tasks/<upid>/status``,
with API-token auth (``Authorization: PVEAPIToken=<user>!<name>=<secret>``). Errors come as PVE sends
them: the message in the HTTP reason phrase, ``{"data": null}`` as the body.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import re
import ssl
import threading
import time
import typing as t
from pathlib import Path

from testkit import pct as pct_program

if t.TYPE_CHECKING:
    from testkit.pve import FakePve


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 (the client runs with verify_ssl = false)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    crt, pem = folder / "pveproxy.crt", folder / "pveproxy.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return crt, pem


class FakePveApi:
    """``with FakePveApi(fake_pve, token_value="s3cret") as api:`` then point proxmoxer at ``api.port``."""

    def __init__(
        self, pve: FakePve, *, user: str = "root@pam", token_name: str = "dflashctl", token_value: str = "s3cret"
    ) -> None:
        self.pve = pve
        self.auth = f"PVEAPIToken={user}!{token_name}={token_value}"
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for assertions
        self.tasks: dict[str, dict[str, t.Any]] = {}
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def start(self) -> FakePveApi:
        crt, key = self_signed_cert(self.pve.root)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(crt, key)
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: t.Any) -> None:
                pass

            def do_GET(self) -> None:
                api._handle(self, "GET")

            def do_POST(self) -> None:
                api._handle(self, "POST")

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, daemon=True, name="fake-pve-api")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakePveApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests -------------------------------------------------------------------------------

    def _handle(self, req: http.server.BaseHTTPRequestHandler, method: str) -> None:
        path = req.path.split("?", 1)[0]
        self.requests.append((method, path))
        length = int(req.headers.get("Content-Length") or 0)
        if length:
            req.rfile.read(length)
        if req.headers.get("Authorization") != self.auth:
            return self._reply(req, 401, "invalid token value!", None)
        node = re.escape(self.pve.node)
        if m := re.fullmatch(rf"/api2/json/nodes/{node}/lxc/(\d+)/status/current", path):
            if method == "GET":
                return self._status(req, m.group(1))
        elif m := re.fullmatch(rf"/api2/json/nodes/{node}/lxc/(\d+)/status/start", path):
            if method == "POST":
                return self._start(req, m.group(1))
        elif m := re.fullmatch(rf"/api2/json/nodes/{node}/tasks/([^/]+)/status", path):
            if method == "GET":
                from urllib.parse import unquote

                task = self.tasks.get(unquote(m.group(1)))
                if task is None:
                    return self._reply(req, 500, "no such task", None)
                return self._reply(req, 200, "OK", task)
        return self._reply(req, 501, f"Method '{method} {path}' not implemented", None)

    def _status(self, req: http.server.BaseHTTPRequestHandler, vmid: str) -> None:
        st = pct_program.State(self.pve.state)
        if not st.conf(vmid).is_file():
            return self._reply(
                req, 500, f"Configuration file 'nodes/{self.pve.node}/lxc/{vmid}.conf' does not exist", None
            )
        info = st.init_info(vmid)
        data: dict[str, t.Any] = {
            "vmid": int(vmid),
            "name": f"ct{vmid}",
            "type": "lxc",
            "status": "running" if info else "stopped",
            "uptime": int(time.time() - float(info["started_at"])) if info else 0,
            "cpus": 1,
            "maxmem": 2 << 30,
            "mem": 0,
            "maxdisk": 8 << 30,
            "disk": 0,
            "maxswap": 512 << 20,
            "swap": 0,
            "netin": 0,
            "netout": 0,
            "diskread": 0,
            "diskwrite": 0,
            "ha": {"managed": 0},
        }
        if info:
            data["pid"] = int(info["pid"])
        return self._reply(req, 200, "OK", data)

    def _start(self, req: http.server.BaseHTTPRequestHandler, vmid: str) -> None:
        st = pct_program.State(self.pve.state)
        if not st.conf(vmid).is_file():
            return self._reply(
                req, 500, f"Configuration file 'nodes/{self.pve.node}/lxc/{vmid}.conf' does not exist", None
            )
        if st.init_info(vmid):
            return self._reply(req, 500, f"CT {vmid} already running", None)
        started = int(time.time())
        upid = (
            f"UPID:{self.pve.node}:{started & 0xFFFFFF:08X}:00000000:{started:08X}:vzstart:{vmid}:root@pam!dflashctl:"
        )
        r = self.pve.pct_run("start", vmid)
        self.tasks[upid] = {
            "upid": upid,
            "node": self.pve.node,
            "type": "vzstart",
            "id": vmid,
            "status": "stopped",
            "exitstatus": "OK" if r.returncode == 0 else r.stderr.decode(errors="replace").strip(),
            "starttime": started,
        }
        return self._reply(req, 200, "OK", upid)

    def _reply(self, req: http.server.BaseHTTPRequestHandler, code: int, reason: str, data: t.Any) -> None:
        body = json.dumps({"data": data}).encode()
        req.send_response(code, reason)
        req.send_header("Content-Type", "application/json;charset=UTF-8")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)
