// The sending loop of iap-server's FileSender (Sources/ContentDelivery/FileSender.swift), in C and
// nothing else, for tools/bench-cork.sh: an epoll set, level-triggered, one `sendfile` of at most
// 2 MiB per wake-up, after a response head written under TCP_CORK. With `corked` the socket stays
// corked until the body has left, as iap-server and nginx (`tcp_nopush`) send a file; with
// `uncorked` the cork comes off after the first turn, so each turn's last segment leaves at once.
// Two more choices, to see what moves a loopback download's CPU figures: the turn (KiB per
// `sendfile`, 2048 by default) and the trigger: `level` (FileSender's) or `edge`, which sends turn
// after turn until the socket is full (EAGAIN) and then waits for the edge, as nginx does, or
// `blocking`: no epoll and a blocking socket, one `sendfile` of the whole file that sleeps in the
// kernel whenever the socket is full (no return to user space per turn; the turn is not used).
// One connection at a time, every request answered with the whole file: a measuring peer, not a
// server.
//
// Usage: sendloop <address> <port> <file> corked|uncorked [<turn KiB> [level|edge|blocking]]
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

static void set_cork(int fd, int on) { setsockopt(fd, IPPROTO_TCP, TCP_CORK, &on, sizeof on); }

int main(int argc, char **argv) {
  if (argc < 5 || argc > 7 || (strcmp(argv[4], "corked") && strcmp(argv[4], "uncorked")) ||
      (argc > 5 && atoi(argv[5]) <= 0) || (argc > 6 && strcmp(argv[6], "level") && strcmp(argv[6], "edge") && strcmp(argv[6], "blocking"))) {
    fprintf(stderr, "usage: sendloop <address> <port> <file> corked|uncorked [<turn KiB> [level|edge|blocking]]\n");
    return 2;
  }
  int corked_through = strcmp(argv[4], "corked") == 0;
  int edge = argc > 6 && strcmp(argv[6], "edge") == 0;
  int blocking = argc > 6 && strcmp(argv[6], "blocking") == 0;
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
  if (inet_pton(AF_INET, argv[1], &address.sin_addr) != 1 || bind(listener, (struct sockaddr *)&address, sizeof address) ||
      listen(listener, 16)) {
    perror("sendloop: listen");
    return 1;
  }
  int set = epoll_create1(EPOLL_CLOEXEC);
  // 2 MiB by default: nginx's sendfile_max_chunk, and FileSender's turn.
  const off_t turn = argc > 5 ? (off_t)atoi(argv[5]) << 10 : 2 << 20;
  for (;;) {
    int connection = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
    if (connection < 0) continue;
    char request[4096];
    if (read(connection, request, sizeof request) <= 0) { close(connection); continue; }
    int file = open(argv[3], O_RDONLY | O_CLOEXEC);
    struct stat status;
    if (file < 0 || fstat(file, &status)) { perror("sendloop: open"); return 1; }
    char head[160];
    int length = snprintf(head, sizeof head, "HTTP/1.1 200 OK\r\nContent-Length: %lld\r\nConnection: close\r\n\r\n",
                          (long long)status.st_size);
    set_cork(connection, 1);
    if (write(connection, head, length) != length) { close(file); close(connection); continue; }
    if (blocking) {
      off_t offset = 0;
      while (offset < status.st_size) {
        ssize_t sent = sendfile(connection, file, &offset, status.st_size - offset);
        if (sent < 0 && errno == EINTR) continue;
        if (sent <= 0) break;
      }
      set_cork(connection, 0);
      close(file);
      close(connection);
      continue;
    }
    fcntl(connection, F_SETFL, O_NONBLOCK);
    struct epoll_event event = {.events = EPOLLOUT | (edge ? EPOLLET : 0), .data.fd = connection}, ready;
    epoll_ctl(set, EPOLL_CTL_ADD, connection, &event);
    off_t offset = 0;
    int corked = 1;
    while (offset < status.st_size) {
      if (epoll_wait(set, &ready, 1, -1) < 0) continue;
      ssize_t sent;
      do {  // one turn per wake-up, level-triggered; edge-triggered, turns until the socket is full
        off_t left = status.st_size - offset;
        sent = left > 0 ? sendfile(connection, file, &offset, left < turn ? left : turn) : 0;
      } while (edge && (sent > 0 || (sent < 0 && errno == EINTR)));  // an edge is not reported twice
      if (sent < 0 && errno != EAGAIN && errno != EINTR) break;  // the client went away
      if (sent == 0 && offset < status.st_size) break;           // the file was cut short
      if (corked && !corked_through) { set_cork(connection, 0); corked = 0; }
    }
    set_cork(connection, 0);
    epoll_ctl(set, EPOLL_CTL_DEL, connection, NULL);
    close(file);
    close(connection);
  }
}
