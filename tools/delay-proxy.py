#!/usr/bin/env python3
"""A TCP forwarder that delays every byte by half a round trip each way, and the connection's
set-up by a whole one: the round trip of a real network, where this kernel has no netem.
Usage: delay-proxy.py <listen-host> <listen-port> <target-host> <target-port> <rtt-ms>"""
import asyncio, collections, sys

host, port, target_host, target_port, rtt = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]) / 1000
half = rtt / 2
HIGH = 4 << 20  # bytes held per direction before the reader waits: TCP's window does the rest


async def pipe(reader, writer):
    loop = asyncio.get_running_loop()
    queue, held, more, room = collections.deque(), [0], asyncio.Event(), asyncio.Event()

    async def send():
        while True:
            while not queue:
                more.clear()
                await more.wait()
            due, chunk = queue.popleft()
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if chunk is None:
                writer.write_eof() if writer.can_write_eof() else writer.close()
                return
            writer.write(chunk)
            await writer.drain()
            held[0] -= len(chunk)
            room.set()

    sender = asyncio.ensure_future(send())
    try:
        while True:
            chunk = await reader.read(256 << 10)
            queue.append((loop.time() + half, chunk or None))
            more.set()
            if not chunk:
                break
            held[0] += len(chunk)
            while held[0] > HIGH:
                room.clear()
                await room.wait()
        await sender
    except (ConnectionError, asyncio.CancelledError):
        sender.cancel()
    finally:
        try:
            writer.close()
        except Exception:
            pass


async def handle(client_reader, client_writer):
    await asyncio.sleep(rtt)  # SYN, SYN-ACK
    try:
        server_reader, server_writer = await asyncio.open_connection(target_host, target_port)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer), return_exceptions=True)


async def main():
    server = await asyncio.start_server(handle, host, port)
    async with server:
        await server.serve_forever()


asyncio.run(main())
