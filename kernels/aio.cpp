// Asynchronous reads and writes of aligned buffers to O_DIRECT files, for the NVMe offload store.
// Exported with a C ABI; zerorun/ops.py builds it with torch.utils.cpp_extension (no torch headers)
// and zerorun/runtime/aio.py calls it through ctypes.
//
// A request is (fd, buffer, nbytes, file offset, read|write). `zr_aio_submit` cuts it into chunks of
// `block_size` bytes, queues them and returns a handle at once; at most `queue_depth` chunks are in
// flight per engine, in submission order; `zr_aio_wait` blocks until every chunk of the request is
// done and returns 0 or the first errno, with a message that says what failed and where.
//
// Two backends, picked at run time:
// - native Linux AIO through raw syscalls (io_setup/io_submit/io_getevents, <linux/aio_abi.h>; no
//   libaio library needed). One service thread submits queued chunks and reaps completions; it
//   sleeps on an eventfd that both the kernel (IOCB_FLAG_RESFD, on each completion) and submitters
//   (on new work) signal, so new work never waits behind a completion.
// - a pool of threads doing pread/pwrite, for kernels or containers that refuse io_setup.
//
// Errors are per request: a request on an O_DIRECT fd that is not 4096-aligned fails at once with
// EINVAL naming the misaligned field (whatever the file system would do with it), a short read (past the
// end of the file) or short write (disk full) is an error, not a silent partial transfer.
#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

enum Backend : int { kAuto = 0, kNative = 1, kThreads = 2 };
const char* const kBackendNames[] = {"auto", "libaio", "threads"};

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void copy_message(const std::string& text, char* out, int out_len) {
  if (out == nullptr || out_len <= 0) return;
  snprintf(out, size_t(out_len), "%s", text.c_str());
}

struct Request {
  int64_t chunks_left = 0;
  int error = 0;  // the first chunk's errno, 0 if all succeeded
  std::string message;
  int64_t submitted_ns = 0;
  int64_t completed_ns = 0;
  bool done = false;
};

struct Chunk {
  int64_t request;
  int fd;
  char* buf;
  int64_t nbytes;
  int64_t offset;
  bool write;
};

std::string describe_failure(const Chunk& c, int64_t result) {
  char text[512];
  const char* op = c.write ? "write" : "read";
  if (result >= 0) {  // a short transfer: past the end of the file, or the disk is full
    snprintf(text, sizeof text, "short %s: %lld of %lld bytes at file offset %lld (fd %d)%s", op,
             (long long)result, (long long)c.nbytes, (long long)c.offset, c.fd,
             c.write ? "; is the disk full?" : "; the file ends before the requested range");
  } else if (result == -EINVAL) {
    auto ok = [](int64_t v) { return v % 4096 == 0 ? "aligned" : "NOT aligned"; };
    snprintf(text, sizeof text,
             "%s failed: EINVAL (Invalid argument) at file offset %lld: O_DIRECT needs the buffer address, length "
             "and file offset aligned to 4096 bytes: buffer %p (%s), length %lld (%s), offset %lld (%s)",
             op, (long long)c.offset, (void*)c.buf, ok(int64_t(uintptr_t(c.buf))), (long long)c.nbytes,
             ok(c.nbytes), (long long)c.offset, ok(c.offset));
  } else {
    snprintf(text, sizeof text, "%s failed: %s (errno %d) at file offset %lld, %lld bytes (fd %d)", op,
             strerror(int(-result)), int(-result), (long long)c.offset, (long long)c.nbytes, c.fd);
  }
  return text;
}

bool misaligned_direct(int fd, const char* buf, int64_t nbytes, int64_t offset) {
  int flags = fcntl(fd, F_GETFL);
  return flags >= 0 && (flags & O_DIRECT) && ((int64_t(uintptr_t(buf)) | nbytes | offset) % 4096 != 0);
}

class Engine {
 public:
  Engine(int queue_depth, int64_t block_size) : queue_depth_(queue_depth), block_size_(block_size) {}
  virtual ~Engine() = default;
  virtual int backend() const = 0;
  virtual void stop() = 0;

  int64_t submit(int fd, char* buf, int64_t nbytes, int64_t offset, bool write) {
    std::unique_lock<std::mutex> lock(mu_);
    int64_t id = next_id_++;
    Request& r = requests_[id];
    r.submitted_ns = now_ns();
    if (misaligned_direct(fd, buf, nbytes, offset)) {  // some kernels would quietly fall back to buffered I/O
      r.error = EINVAL;
      r.message = describe_failure(Chunk{id, fd, buf, nbytes, offset, write}, -EINVAL);
      r.done = true;
      r.completed_ns = r.submitted_ns;
      return id;
    }
    for (int64_t done = 0; done < nbytes; done += block_size_) {
      int64_t n = nbytes - done < block_size_ ? nbytes - done : block_size_;
      pending_.push_back(Chunk{id, fd, buf + done, n, offset + done, write});
      ++r.chunks_left;
    }
    if (r.chunks_left == 0) {
      r.done = true;
      r.completed_ns = r.submitted_ns;
      return id;
    }
    lock.unlock();
    notify();
    return id;
  }

  // 0, or the request's errno (message in `err`); -1 for an unknown handle. Forgets the request.
  int wait(int64_t id, int64_t* inflight_ns, char* err, int err_len) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end()) {
      copy_message("unknown or already waited-for request handle", err, err_len);
      return -1;
    }
    done_cv_.wait(lock, [&] { return it->second.done; });
    Request r = std::move(it->second);
    requests_.erase(it);
    if (inflight_ns != nullptr) *inflight_ns = r.completed_ns - r.submitted_ns;
    copy_message(r.message, err, err_len);
    return r.error;
  }

  // 1 if the request is done (wait will not block), 0 if not, -1 for an unknown handle.
  int poll(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = requests_.find(id);
    return it == requests_.end() ? -1 : int(it->second.done);
  }

 protected:
  virtual void notify() = 0;

  // Record one chunk's result (bytes transferred, or -errno). Call with mu_ held.
  void complete_locked(const Chunk& c, int64_t result) {
    Request& r = requests_[c.request];
    if (result != c.nbytes && r.error == 0) {
      r.error = result < 0 ? int(-result) : (c.write ? ENOSPC : EIO);
      r.message = describe_failure(c, result);
    }
    if (--r.chunks_left == 0) {
      r.done = true;
      r.completed_ns = now_ns();
      done_cv_.notify_all();
    }
  }

  void cancel_pending_locked() {
    while (!pending_.empty()) {
      complete_locked(pending_.front(), -ECANCELED);
      pending_.pop_front();
    }
  }

  const int queue_depth_;
  const int64_t block_size_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  std::deque<Chunk> pending_;
  std::unordered_map<int64_t, Request> requests_;
  int64_t next_id_ = 1;
  bool stopping_ = false;
};

// ---- native Linux AIO -------------------------------------------------------------------------

long sys_io_setup(unsigned n, aio_context_t* ctx) { return syscall(__NR_io_setup, n, ctx); }
long sys_io_destroy(aio_context_t ctx) { return syscall(__NR_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, iocb** iocbs) { return syscall(__NR_io_submit, ctx, n, iocbs); }
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, io_event* events, timespec* timeout) {
  return syscall(__NR_io_getevents, ctx, min_nr, nr, events, timeout);
}

class NativeEngine : public Engine {
 public:
  // Throws nothing: `ok()` says whether the kernel gave us a context, `reason()` why not.
  NativeEngine(int queue_depth, int64_t block_size)
      : Engine(queue_depth, block_size), iocbs_(size_t(queue_depth)), chunks_(size_t(queue_depth)) {
    if (sys_io_setup(unsigned(queue_depth), &ctx_) != 0) {
      reason_ = std::string("io_setup: ") + strerror(errno);
      ctx_ = 0;
      return;
    }
    efd_ = eventfd(0, EFD_CLOEXEC);
    if (efd_ < 0) {
      reason_ = std::string("eventfd: ") + strerror(errno);
      sys_io_destroy(ctx_);
      ctx_ = 0;
      return;
    }
    for (int slot = queue_depth - 1; slot >= 0; --slot) free_.push_back(slot);
    service_ = std::thread([this] { serve(); });
  }

  ~NativeEngine() override { stop(); }

  bool ok() const { return ctx_ != 0; }
  const std::string& reason() const { return reason_; }
  int backend() const override { return kNative; }

  void stop() override {
    if (!service_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    notify();
    service_.join();
    sys_io_destroy(ctx_);
    close(efd_);
  }

 protected:
  void notify() override {
    uint64_t one = 1;
    while (::write(efd_, &one, sizeof one) < 0 && errno == EINTR) {
    }
  }

 private:
  void serve() {
    std::vector<iocb*> batch;
    std::vector<io_event> events(static_cast<size_t>(queue_depth_));
    for (;;) {
      batch.clear();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) cancel_pending_locked();
        if (stopping_ && inflight_ == 0) return;
        while (!pending_.empty() && !free_.empty()) {
          int slot = free_.back();
          free_.pop_back();
          chunks_[size_t(slot)] = pending_.front();
          pending_.pop_front();
          batch.push_back(prepare(slot));
          ++inflight_;
        }
      }
      if (!submit_batch(batch)) continue;  // a refused chunk freed its slot: refill before sleeping
      uint64_t signalled;
      while (read(efd_, &signalled, sizeof signalled) < 0 && errno == EINTR) {
      }
      reap(events);
    }
  }

  iocb* prepare(int slot) {
    const Chunk& c = chunks_[size_t(slot)];
    iocb* cb = &iocbs_[size_t(slot)];
    memset(cb, 0, sizeof *cb);
    cb->aio_data = uint64_t(slot);
    cb->aio_lio_opcode = c.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    cb->aio_fildes = uint32_t(c.fd);
    cb->aio_buf = uint64_t(uintptr_t(c.buf));
    cb->aio_nbytes = uint64_t(c.nbytes);
    cb->aio_offset = c.offset;
    cb->aio_flags = IOCB_FLAG_RESFD;
    cb->aio_resfd = uint32_t(efd_);
    return cb;
  }

  // io_submit may take fewer than asked, or refuse the first one (its errno is that chunk's error).
  // False if a chunk was refused.
  bool submit_batch(const std::vector<iocb*>& batch) {
    bool all = true;
    size_t next = 0;
    while (next < batch.size()) {
      long taken = sys_io_submit(ctx_, long(batch.size() - next), const_cast<iocb**>(batch.data() + next));
      if (taken > 0) {
        next += size_t(taken);
        continue;
      }
      int error = taken == 0 ? EAGAIN : errno;
      if (error == EINTR) continue;
      std::lock_guard<std::mutex> lock(mu_);
      finish_slot_locked(int(batch[next]->aio_data), -int64_t(error));
      ++next;
      all = false;
    }
    return all;
  }

  void reap(std::vector<io_event>& events) {
    timespec zero{0, 0};
    for (;;) {
      long n = sys_io_getevents(ctx_, 0, long(events.size()), events.data(), &zero);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      std::lock_guard<std::mutex> lock(mu_);
      for (long i = 0; i < n; ++i) finish_slot_locked(int(events[size_t(i)].data), int64_t(events[size_t(i)].res));
    }
  }

  void finish_slot_locked(int slot, int64_t result) {
    complete_locked(chunks_[size_t(slot)], result);
    free_.push_back(slot);
    --inflight_;
  }

  aio_context_t ctx_ = 0;
  int efd_ = -1;
  std::string reason_;
  std::vector<iocb> iocbs_;   // one per queue slot
  std::vector<Chunk> chunks_;  // the chunk each slot carries
  std::vector<int> free_;
  int inflight_ = 0;
  std::thread service_;
};

// ---- thread pool of pread/pwrite -------------------------------------------------------------

class ThreadEngine : public Engine {
 public:
  // min(threads, queue_depth) workers: each keeps one chunk in flight.
  ThreadEngine(int queue_depth, int64_t block_size, int threads) : Engine(queue_depth, block_size) {
    int n = threads < queue_depth ? threads : queue_depth;
    for (int i = 0; i < (n > 0 ? n : 1); ++i) workers_.emplace_back([this] { work(); });
  }

  ~ThreadEngine() override { stop(); }
  int backend() const override { return kThreads; }

  void stop() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      cancel_pending_locked();
    }
    work_cv_.notify_all();
    for (auto& t : workers_)
      if (t.joinable()) t.join();
  }

 protected:
  void notify() override { work_cv_.notify_all(); }

 private:
  void work() {
    for (;;) {
      Chunk c;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
        if (pending_.empty()) return;
        c = pending_.front();
        pending_.pop_front();
      }
      int64_t result = transfer(c);
      std::lock_guard<std::mutex> lock(mu_);
      complete_locked(c, result);
    }
  }

  // Bytes moved (fewer than asked only at the end of the file), or -errno.
  static int64_t transfer(const Chunk& c) {
    int64_t done = 0;
    while (done < c.nbytes) {
      ssize_t n = c.write ? pwrite(c.fd, c.buf + done, size_t(c.nbytes - done), c.offset + done)
                          : pread(c.fd, c.buf + done, size_t(c.nbytes - done), c.offset + done);
      if (n < 0) {
        if (errno == EINTR) continue;
        return -int64_t(errno);
      }
      if (n == 0) break;
      done += n;
    }
    return done;
  }

  std::condition_variable work_cv_;
  std::vector<std::thread> workers_;
};

}  // namespace

extern "C" {

// A new engine, or NULL with the reason in `err`. backend: 0 auto (native AIO, else threads),
// 1 native AIO only, 2 threads.
void* zr_aio_create(int backend, int queue_depth, int threads, int64_t block_size, char* err, int err_len) {
  if (queue_depth < 1 || threads < 1 || block_size < 4096 || block_size % 4096 != 0 || backend < 0 || backend > 2) {
    copy_message("invalid settings: queue_depth and threads must be >= 1, block_size a positive multiple of 4096",
                 err, err_len);
    return nullptr;
  }
  if (backend != kThreads) {
    auto* native = new NativeEngine(queue_depth, block_size);
    if (native->ok()) return native;
    std::string why = "native AIO unavailable (" + native->reason() + ")";
    delete native;
    if (backend == kNative) {
      copy_message(why, err, err_len);
      return nullptr;
    }
  }
  return new ThreadEngine(queue_depth, block_size, threads);
}

int zr_aio_backend(void* engine) { return static_cast<Engine*>(engine)->backend(); }

const char* zr_aio_backend_name(int backend) { return backend >= 0 && backend <= 2 ? kBackendNames[backend] : "?"; }

int64_t zr_aio_submit(void* engine, int fd, void* buf, int64_t nbytes, int64_t offset, int is_write) {
  if (nbytes < 0 || offset < 0) return -EINVAL;
  return static_cast<Engine*>(engine)->submit(fd, static_cast<char*>(buf), nbytes, offset, is_write != 0);
}

int zr_aio_wait(void* engine, int64_t handle, int64_t* inflight_ns, char* err, int err_len) {
  return static_cast<Engine*>(engine)->wait(handle, inflight_ns, err, err_len);
}

int zr_aio_poll(void* engine, int64_t handle) { return static_cast<Engine*>(engine)->poll(handle); }

// Waits for the chunks in flight, cancels queued ones, frees the engine.
void zr_aio_destroy(void* engine) { delete static_cast<Engine*>(engine); }

}  // extern "C"
