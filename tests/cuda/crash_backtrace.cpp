// SPDX-License-Identifier: Apache-2.0
// A host backtrace on a fatal signal for the CUDA test binary: under
// compute-sanitizer (and on GPU machines without a debugger) a host crash is
// otherwise reported only as "process didn't terminate successfully". The
// frames are printed as object(+offset), which addr2line resolves against the
// unstripped binary.
#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <initializer_list>

namespace {

void print_backtrace_and_reraise(int sig) {
  const char* what = strsignal(sig);
  (void)!write(STDERR_FILENO, "\n*** fatal signal: ", 19);
  (void)!write(STDERR_FILENO, what, std::strlen(what));
  (void)!write(STDERR_FILENO, "\n", 1);
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(sig, SIG_DFL);  // the default action ends the process as before
  std::raise(sig);
}

// Installed before main by a static object.
struct InstallHandler {
  InstallHandler() {
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) {
      std::signal(sig, print_backtrace_and_reraise);
    }
  }
} const install_handler;

}  // namespace
