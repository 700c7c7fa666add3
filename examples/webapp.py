"""A small HTTP app for a socket pool (examples/sockets.toml): every replica serves on the
listening socket the daemon passed it, so all of them share one port.

    orchestrator launch --pool web --count 3 --socket tcp://127.0.0.1:8000 \
        --ready notify --target webapp:serve --cwd examples
"""

from __future__ import annotations

import http.server
import os

from orchestrator.worker import listen_sockets, ready


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"hello from {os.environ.get('ORCHESTRATOR_REPLICA_ID', os.getpid())}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve() -> None:
    (sock,) = listen_sockets()  # fd 3, as systemd's sd_listen_fds() finds it
    server = http.server.ThreadingHTTPServer(sock.getsockname()[:2], Hello, bind_and_activate=False)
    server.socket.close()
    server.socket = sock  # already bound and listening: the daemon did it, once
    ready()
    try:
        server.serve_forever()
    finally:
        server.server_close()
