#!/usr/bin/env python3
"""HTTP lint for a running server, with mnot's REDbot and httplint (PyPI: redbot).

    tools/http-lint.py exchanges.json

exchanges.json:
    {"port": 8080,
     "exchanges": [{"name": "...", "method": "GET", "target": "/path",
                    "headers": [["Range", "bytes=0-9"]], "body": null}, ...],
     "probe": [{"name": "...", "url": "http://127.0.0.1:8080/path"}, ...]}

Each exchange is sent as written on a connection of its own and its response linted by
httplint, with the request beside it (a HEAD's response, a range's 206). Each probe URL is
given to REDbot, which fetches it and then checks it actively: a ranged request, If-None-Match,
If-Modified-Since, content negotiation. Prints a JSON list, one entry per exchange or probe:
name, status, every note (level good/info/warn/bad, its id and summary, subnotes flattened),
the WWW-Authenticate challenge when there is one, and for a multipart/byteranges response how many parts it has and how many carry a
Content-Range. Exits 0 when every exchange and probe ran, whatever the notes say: judging them
is the caller's part (Tests/ContentServerTests/HTTPLintTests.swift).
"""
import json
import socket
import subprocess
import sys
import time

from httplint import HttpRequestLinter, HttpResponseLinter

MAX_RESPONSE = 16 << 20


def send(port, method, target, headers, body):
    head = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: http-lint\r\nConnection: close\r\n"
    for name, value in headers:
        head += f"{name}: {value}\r\n"
    if body is not None:
        head += f"Content-Length: {len(body)}\r\n"
    started = time.time()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as connection:
        connection.sendall(head.encode("latin-1") + b"\r\n" + (body or b""))
        data = b""
        while len(data) < MAX_RESPONSE:
            chunk = connection.recv(65536)
            if not chunk:
                break
            data += chunk
    return started, data


def notes_of(notes):
    out = []
    for note in notes:
        out.append({"level": note.level.name.lower(), "id": type(note).__name__, "summary": note.summary})
        out.extend(notes_of(getattr(note, "subnotes", []) or []))
    return out


def byteranges(content_type, content):
    """Parts of a multipart/byteranges body, and how many name their Content-Range."""
    if not content_type.lower().startswith("multipart/byteranges"):
        return None
    boundary = content_type.split("boundary=", 1)[1].strip().strip('"').encode()
    parts = content.split(b"--" + boundary)[1:-1]
    with_range = sum(1 for part in parts if b"\r\ncontent-range: bytes " in part.split(b"\r\n\r\n", 1)[0].lower())
    return {"parts": len(parts), "withContentRange": with_range}


def lint_exchange(port, spec):
    method, target = spec["method"], spec["target"]
    headers = [tuple(h) for h in spec.get("headers", [])]
    body = spec["body"].encode() if spec.get("body") is not None else None
    started, data = send(port, method, target, headers, body)
    head, _, content = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    version, status, phrase = (lines[0].split(b" ", 2) + [b""])[:3]
    fields = [tuple(part.strip() for part in line.split(b":", 1)) for line in lines[1:]]

    request = HttpRequestLinter(start_time=started)
    request.process_request_topline(method.encode(), target.encode(), b"HTTP/1.1")
    sent = [(b"Host", b"127.0.0.1"), (b"User-Agent", b"http-lint")] + [(n.encode(), v.encode()) for n, v in headers]
    request.process_headers(sent)
    if body:
        request.feed_content(body)
    request.finish_content(True)

    response = HttpResponseLinter(start_time=started)
    response.request = request
    response.is_head_response = method == "HEAD"
    response.process_response_topline(version, status, phrase)
    response.process_headers(fields)
    if method != "HEAD":
        response.feed_content(content)
    response.finish_content(True)

    content_type = next((v.decode("latin-1") for n, v in fields if n.lower() == b"content-type"), "")
    result = {"name": spec["name"], "status": int(status), "notes": notes_of(response.notes)}
    challenge = next((v.decode("latin-1") for n, v in fields if n.lower() == b"www-authenticate"), None)
    if challenge is not None:
        result["challenge"] = challenge
    parts = byteranges(content_type, content)
    if parts is not None:
        result["byteranges"] = parts
    return result


def probe(spec):
    run = subprocess.run([sys.executable, "-m", "redbot.cli", "-o", "har", spec["url"]], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise SystemExit(f"redbot failed on {spec['name']}: {run.stderr.strip()}")
    entries = json.loads(run.stdout)["log"]["entries"]
    notes = []

    def flatten(items):
        for item in items:
            notes.append({"level": item["level"].lower(), "id": item["note_id"], "summary": item["summary"]})
            flatten(item.get("subnotes", []))

    for entry in entries:
        flatten(entry.get("_red_messages", []))
    return {"name": spec["name"], "status": entries[0]["response"]["status"] if entries else 0, "notes": notes}


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as file:
        plan = json.load(file)
    results = [lint_exchange(plan["port"], spec) for spec in plan.get("exchanges", [])]
    results += [probe(spec) for spec in plan.get("probe", [])]
    json.dump(results, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
