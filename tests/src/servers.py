# Servers run inside lab pods (shipped with the nattrace lab).
#   servers.py http <port> <pod name> <pod ip>
#   servers.py dns  <port> <name> <answer ip>
# Each prints "ready" on stdout once its socket is bound, so the lab knows
# the pod can be reached before a test sends traffic.
import http.server
import socket
import struct
import sys


def http_server(port, pod, ip):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            host, cport = self.client_address[:2]
            body = f"pod={pod} ip={ip} client={host}:{cport}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer.allow_reuse_address = True
    srv = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    print("ready", flush=True)
    srv.serve_forever()


def dns_server(port, name, answer):
    name = name.rstrip(".").lower()
    rdata = socket.inet_aton(answer)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    print("ready", flush=True)
    while True:
        data, peer = sock.recvfrom(4096)
        reply = dns_reply(data, name, rdata)
        if reply:
            sock.sendto(reply, peer)


def dns_reply(data, name, rdata):
    if len(data) < 12:
        return None
    tid, flags, qdcount = struct.unpack("!HHH", data[:6])
    if flags & 0x8000 or qdcount != 1:
        return None
    i, labels = 12, []
    while i < len(data):
        n = data[i]
        i += 1
        if n == 0:
            break
        if n & 0xC0:
            return None
        labels.append(data[i:i + n].decode("ascii", "replace"))
        i += n
    if i + 4 > len(data):
        return None
    qtype, _qclass = struct.unpack("!HH", data[i:i + 4])
    question = data[12:i + 4]
    qname = ".".join(labels).lower()
    answers, rcode = b"", 3
    if qname == name:
        rcode = 0
        if qtype == 1:
            answers = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 30, 4) + rdata
    # QR, AA, RA set; RD copied from the query.
    out_flags = 0x8000 | 0x0400 | 0x0080 | (flags & 0x0100) | rcode
    header = struct.pack("!HHHHHH", tid, out_flags, 1, 1 if answers else 0, 0, 0)
    return header + question + answers


if __name__ == "__main__":
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "http":
        http_server(port, sys.argv[3], sys.argv[4])
    elif mode == "dns":
        dns_server(port, sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"unknown mode {mode}")
