#if os(Linux)
    import Glibc

    /// How many bytes of `range` of the file at `path` are in the page cache (`mincore(2)` on a
    /// mapping), for tests of what a reader or writer leaves cached. `range` starts on a page.
    public func cachedBytes(of path: String, in range: Range<Int>) -> Int {
        let page = Int(sysconf(Int32(_SC_PAGESIZE)))
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0, range.lowerBound % page == 0, !range.isEmpty else { return -1 }
        defer { close(fd) }
        guard let map = mmap(nil, range.count, PROT_READ, MAP_SHARED, fd, off_t(range.lowerBound)), map != MAP_FAILED else { return -1 }
        defer { munmap(map, range.count) }
        var pages = [UInt8](repeating: 0, count: (range.count + page - 1) / page)
        guard mincore(map, range.count, &pages) == 0 else { return -1 }
        return pages.reduce(0) { $0 + Int($1 & 1) } * page
    }

    /// Runs `scenario` until a run finds the pages it expects to stay in the page cache there
    /// (it returns whether it did), at most `attempts` times; returns whether one did. The
    /// scenario asserts what must hold in every run itself (pages dropped, bytes intact), each run
    /// on files of its own.
    ///
    /// Why: this VM type runs DAMON with a `pageout` scheme, which evicts page-cache pages it
    /// finds cold in regions of physical memory, whoever holds them: pages the code under test
    /// kept can be gone a moment later (the check's page-cache test failed that way in two loaded
    /// full runs). Eviction never keeps a page the code dropped, so only a run that fails every
    /// time is the code's doing.
    public func pagesStayed(attempts: Int = 3, _ scenario: () throws -> Bool) rethrows -> Bool {
        for _ in 0..<attempts where try scenario() { return true }
        return false
    }
#endif
