#if os(Linux)
    import CLinuxSendfile
    import Foundation
    import Glibc
    import NIOCore
    import Synchronization

    /// Sends the bodies of large file responses with `sendfile`, from threads of its own that
    /// each wait on an epoll set of their own, for connections whose response head NIO has
    /// written. The connection's handler holds its reads and writes meanwhile.
    ///
    /// Why not NIO's `FileRegion`, which every other response uses: across a link the server
    /// wakes about a thousand times per GiB to send what the socket has room for, and NIO's event
    /// loop spends about 4 µs more per wake-up than nginx's (its selector's registration lookup,
    /// the task queue's lock, the pending-write bookkeeping): 1.05-1.09x nginx's CPU per GiB
    /// with the kernel's work the same. A loop that only waits and sends, as nginx's does, took
    /// 0.85x nginx's (docs/performance.md, eighteenth stop). NIO offers no way to hand it a
    /// socket, so the socket is found with ``ChannelSocket`` and duplicated for the send.
    public final class FileSender: Sendable {
        /// One send, as its owner names it to cancel it.
        public struct Ticket: Sendable {
            fileprivate let id: UInt64
            fileprivate let worker: Int
        }

        /// Why a send did not complete.
        public enum Failure: Error, Equatable, Sendable {
            /// The socket refused the bytes (the peer closed or reset the connection): `errno`.
            /// From `init`: the system refused an epoll set or eventfd.
            case socket(CInt)
            /// The file ended before the bytes promised were sent (it was cut short on disk).
            case fileEnded(sent: Int64)
            /// The owner cancelled it (its connection closed: a client that stopped reading is
            /// found by its connection's handler, as for any response, see `StalledReader`).
            case cancelled
        }

        private let workers: [Worker]
        private let nextId = Atomic<UInt64>(0)

        /// Starts `threads` sending threads (at least one); throws, having started none, when the
        /// system refuses an epoll set or eventfd (out of descriptors).
        public init(threads: Int) throws(Failure) {
            var made: [Worker] = []
            do {
                for _ in 0..<max(1, threads) { made.append(try Worker()) }
            } catch {
                for worker in made { worker.closeDescriptors() }
                throw error
            }
            for (index, worker) in made.enumerated() { worker.start(name: "iap-send-\(index)") }
            workers = made
        }

        /// Sends `count` bytes of `file` from `offset` to `socket`, then calls `completion` once,
        /// on a sending thread (after a shutdown, at once on the caller's). Takes ownership of
        /// both descriptors (duplicates made for the send): they are closed when it ends. The
        /// socket must be non-blocking. A socket corked for the response (``ChannelSocket/setCork(_:_:)``) is
        /// uncorked when the send ends, so that the body's last segment leaves then, not when the
        /// owner has heard of it.
        public func send(
            socket: CInt, file: CInt, offset: Int64, count: Int64, completion: @escaping @Sendable (Result<Void, Failure>) -> Void
        ) -> Ticket {
            let id = nextId.wrappingAdd(1, ordering: .relaxed).newValue
            let worker = Int(id % UInt64(workers.count))
            workers[worker].submit(.start(Job(id: id, socket: socket, file: file, offset: offset, remaining: count, completion: completion)))
            return Ticket(id: id, worker: worker)
        }

        /// Ends the send at once if it is still running; its completion is called with
        /// `.cancelled`. Nothing happens for one that has ended.
        public func cancel(_ ticket: Ticket) {
            workers[ticket.worker].submit(.cancel(ticket.id))
        }

        /// Cancels every send, ends the threads, and returns once they have ended: every
        /// cancelled send's completion has been called. Sends asked for afterwards fail at once.
        /// An app embedding the server goes on running: its threads must not outlive it.
        public func shutdown() async {
            for worker in workers { await worker.stop() }
        }
    }

    /// Made on the submitting thread, then touched by its worker's thread only.
    private final class Job: @unchecked Sendable {
        let id: UInt64
        let socket: CInt
        let file: CInt
        /// Where the send began: what has been sent is `offset - start`.
        let start: Int64
        var offset: Int64
        var remaining: Int64
        let completion: @Sendable (Result<Void, FileSender.Failure>) -> Void

        init(
            id: UInt64, socket: CInt, file: CInt, offset: Int64, remaining: Int64,
            completion: @escaping @Sendable (Result<Void, FileSender.Failure>) -> Void
        ) {
            (self.id, self.socket, self.file, self.start, self.offset, self.remaining, self.completion) = (
                id, socket, file, offset, offset, remaining, completion
            )
        }

        /// Ends the job: uncorks its socket, closes both descriptors, and reports `result`.
        func finish(_ result: Result<Void, FileSender.Failure>) {
            ChannelSocket.setCork(socket, false)
            close(socket)
            close(file)
            completion(result)
        }
    }

    private enum Command: Sendable {
        case start(Job)
        case cancel(UInt64)
        case stop
    }

    /// One sending thread: its epoll set holds the sockets of its sends and an eventfd that other
    /// threads write to when they hand it a command.
    ///
    /// Level-triggered, unlike nginx's: a send cut short by a file that ended early (truncated
    /// on disk meanwhile) leaves a socket with room, which an edge-triggered set would never
    /// report again, and the connection would hang; level-triggered, the next wait returns at once
    /// and the next send finds the end. A socket that is full is not reported writable until
    /// it has drained to the kernel's threshold either way, so the wake-ups are the same.
    private final class Worker: @unchecked Sendable {
        private let epoll: CInt
        private let wake: CInt
        /// Commands from other threads; everything else is touched by this worker's thread only.
        /// The eventfd is written and closed with its lock held, so that no thread writes to its
        /// number once it is closed (and perhaps given to another file).
        private struct Inbox {
            var commands: [Command] = []
            /// A stop was asked for: later commands are refused.
            var closed = false
            /// The thread has ended and closed its descriptors.
            var ended = false
            /// Who waits for the thread to end.
            var waiting: [CheckedContinuation<Void, Never>] = []
        }
        private let inbox = Mutex(Inbox())
        private var stopping = false
        /// By id, which is also each socket's key in the epoll set: an event still pending for a
        /// send that has ended (its descriptor number perhaps reused since) finds nothing.
        private var jobs: [UInt64: Job] = [:]
        private static let wakeMarker = UInt64.max

        init() throws(FileSender.Failure) {
            epoll = epoll_create1(CInt(EPOLL_CLOEXEC))
            guard epoll >= 0 else { throw .socket(errno) }
            wake = eventfd(0, CInt(EFD_CLOEXEC) | CInt(EFD_NONBLOCK))
            guard wake >= 0 else {
                let code = errno
                close(epoll)
                throw .socket(code)
            }
            var event = epoll_event()
            event.events = EPOLLIN.rawValue
            event.data.u64 = Self.wakeMarker
            guard epoll_ctl(epoll, EPOLL_CTL_ADD, wake, &event) == 0 else {
                let code = errno
                close(wake)
                close(epoll)
                throw .socket(code)
            }
        }

        /// For a worker whose thread never started.
        func closeDescriptors() {
            close(wake)
            close(epoll)
        }

        func start(name: String) {
            // Named in the thread itself: a name set before it starts does not reach the kernel,
            // and a thread's name is what `top -H` and /proc show.
            Thread { [self] in
                clinuxsendfile_name_thread(name)
                // sendfile has no MSG_NOSIGNAL: to a connection the peer has reset it raises
                // SIGPIPE, whose default action ends the process. Blocked on this thread, the
                // signal stays pending here and the call fails with EPIPE instead, whatever the
                // process does with SIGPIPE.
                var pipe = sigset_t()
                sigemptyset(&pipe)
                sigaddset(&pipe, SIGPIPE)
                pthread_sigmask(SIG_BLOCK, &pipe, nil)
                run()
            }.start()
        }

        func submit(_ command: Command) {
            let accepted = inbox.withLock { inbox in
                guard !inbox.closed else { return false }
                inbox.commands.append(command)
                wakeUp()
                return true
            }
            if !accepted, case .start(let job) = command { job.finish(.failure(.cancelled)) }
        }

        /// Asks the thread to cancel its sends and end; returns once it has.
        func stop() async {
            await withCheckedContinuation { continuation in
                let ended = inbox.withLock { inbox in
                    guard !inbox.ended else { return true }
                    inbox.waiting.append(continuation)
                    if !inbox.closed {
                        inbox.closed = true
                        inbox.commands.append(.stop)
                        wakeUp()
                    }
                    return false
                }
                if ended { continuation.resume() }
            }
        }

        /// Called with the inbox's lock held.
        private func wakeUp() {
            var one: UInt64 = 1
            _ = write(wake, &one, 8)
        }

        private func run() {
            var events = [epoll_event](repeating: epoll_event(), count: 64)
            while !stopping {
                let ready = events.withUnsafeMutableBufferPointer { epoll_wait(epoll, $0.baseAddress, CInt($0.count), -1) }
                if ready < 0 { continue }  // EINTR
                for index in 0..<Int(ready) {
                    let key = events[index].data.u64
                    if key == Self.wakeMarker {
                        var count: UInt64 = 0
                        _ = read(wake, &count, 8)
                        let commands = inbox.withLock { inbox in
                            defer { inbox.commands = [] }
                            return inbox.commands
                        }
                        for command in commands { handle(command) }
                        if stopping { break }
                    } else if let job = jobs[key] {
                        pump(job)
                    }
                }
            }
            for job in Array(jobs.values) { end(job, .failure(.cancelled)) }
            let waiting = inbox.withLock { inbox in
                close(wake)
                close(epoll)
                inbox.ended = true
                return inbox.waiting
            }
            for continuation in waiting { continuation.resume() }
        }

        private func handle(_ command: Command) {
            switch command {
            case .start(let job):
                var event = epoll_event()
                event.events = EPOLLOUT.rawValue
                event.data.u64 = job.id
                guard epoll_ctl(epoll, EPOLL_CTL_ADD, job.socket, &event) == 0 else {
                    job.finish(.failure(.socket(errno)))
                    return
                }
                jobs[job.id] = job
                pump(job)
            case .cancel(let id):
                guard let job = jobs[id] else { return }
                end(job, .failure(.cancelled))
            case .stop:
                stopping = true
            }
        }

        /// At most this much per turn of a send, as nginx's `sendfile_max_chunk` (2m by default):
        /// a socket with room left is reported again at the next wait, after the other sends ready.
        private static let turn = 2 << 20

        /// One `sendfile` of up to `turn` bytes: the set reports the socket again while it has
        /// room; ends the send once the body has left or on an error.
        private func pump(_ job: Job) {
            while job.remaining > 0 {
                let asked = Int(min(job.remaining, Int64(Self.turn)))
                var offset = off_t(job.offset)
                let sent = sendfile(job.socket, job.file, &offset, asked)
                if sent > 0 {
                    job.offset += Int64(sent)
                    job.remaining -= Int64(sent)
                    if job.remaining > 0 { return }
                } else if sent == 0 {
                    end(job, .failure(.fileEnded(sent: job.offset - job.start)))
                    return
                } else if errno == EAGAIN {
                    return
                } else if errno != EINTR {
                    end(job, .failure(.socket(errno)))
                    return
                }
            }
            end(job, .success(()))
        }

        private func end(_ job: Job, _ result: Result<Void, FileSender.Failure>) {
            _ = epoll_ctl(epoll, EPOLL_CTL_DEL, job.socket, nil)
            jobs[job.id] = nil
            job.finish(result)
        }
    }
#else
    /// Elsewhere than Linux, large bodies go through NIO: there is no sending thread to start.
    public final class FileSender: Sendable {
        public struct Unavailable: Error {}

        public init(threads: Int) throws(Unavailable) { throw Unavailable() }

        public func shutdown() async {}
    }
#endif
