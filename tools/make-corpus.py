#!/usr/bin/env python3
"""Generates the ~1 GiB packing benchmark corpus (deterministic):
about 30% random data (media-like), 55% compressible logs / JSON / float arrays,
15% small text files (5,000 of them)."""
import json, os, random, struct, sys, math

out = sys.argv[1]
scale = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
MiB = 1 << 20
rng = random.Random(2026)

def write(rel, data):
    path = os.path.join(out, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
        f.write(data)

def rand_bytes(n):
    return rng.randbytes(n)

# 30%: incompressible media-like data.
for i in range(4):
    write(f'media/video-{i}.bin', rand_bytes(int(64 * MiB * scale)))
for i in range(50):
    write(f'media/photos/photo-{i:03d}.jpg', rand_bytes(int(1 * MiB * scale)))

# 55%: logs, JSON, float arrays.
paths = [f'/v1/{w}/{i}' for w in ('items', 'users', 'orders', 'levels', 'assets') for i in range(400)]
levels = ['INFO'] * 8 + ['WARN', 'ERROR', 'DEBUG']
templates = []
for i in range(50_000):
    templates.append(f'2026-11-{rng.randint(1,28):02d}T{rng.randint(0,23):02d}:{rng.randint(0,59):02d}:{rng.randint(0,59):02d}.{rng.randint(0,999):03d}Z '
                     f'{rng.choice(levels)} http request_id={rng.getrandbits(48):012x} method={rng.choice(["GET","GET","POST","PUT"])} '
                     f'path={rng.choice(paths)} status={rng.choice([200,200,200,201,304,404,500])} bytes={rng.randint(0,99999)} ms={rng.random()*250:.3f}\n'.encode())
for i in range(5):
    target = int(50 * MiB * scale)
    chunks, size = [], 0
    while size < target:
        block = b''.join(rng.choices(templates, k=4096))
        chunks.append(block)
        size += len(block)
    write(f'logs/server-{i}.log', b''.join(chunks)[:target])
for i in range(30):
    target = int(5 * MiB * scale)
    records, size = [], 0
    while size < target:
        rec = json.dumps({"id": rng.getrandbits(40), "name": rng.choice(["asteroid", "nebula", "comet", "planet", "station"]) + f"-{rng.randint(0, 9999)}",
                          "position": [round(rng.uniform(-1e4, 1e4), 3) for _ in range(3)], "tags": rng.sample(["ice", "rock", "gas", "metal", "rare", "boss"], 2),
                          "hp": rng.randint(1, 5000), "loot": {"gold": rng.randint(0, 500), "gems": rng.randint(0, 5)}}).encode() + b',\n'
        records.append(rec)
        size += len(rec)
    write(f'data/entities-{i:02d}.json', b'[\n' + b''.join(records)[:target - 4] + b'{}]\n')
for i in range(8):
    n = int(20 * MiB * scale) // 4
    t0 = rng.random() * 10
    values = [round(math.sin(t0 + k * 0.001) * 100 + math.sin(k * 0.37) * 3, 2) for k in range(n)]
    write(f'data/curves-{i}.f32', struct.pack(f'<{n}f', *values))

# 15%: 5,000 small text files.
words = 'the of and to in is was for on that with as by at from his an were are which this be or had not but'.split() + \
        'ship engine orbit signal harbour lantern winter river copper meadow quiet paper garden level boss reward'.split()
per = int(154 * MiB * scale) // 5000
for i in range(5000):
    text = ' '.join(rng.choices(words, k=per // 5))
    write(f'text/chapter-{i // 100:02d}/note-{i:04d}.txt', text.encode()[:per] + b'\n')
