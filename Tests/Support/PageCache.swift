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
#endif
