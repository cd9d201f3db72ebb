#include "transfer/mapping_guard.h"

#include <setjmp.h>
#include <signal.h>

#include <mutex>

namespace scalai {
namespace {

// Where a fault on this thread jumps to; null outside ReadMapped.
thread_local sigjmp_buf* t_landing = nullptr;
struct sigaction g_previous;

void OnSigbus(int signal, siginfo_t* info, void* context) {
  if (t_landing != nullptr) siglongjmp(*t_landing, 1);
  // Not a guarded read: whatever handled SIGBUS before does (by default,
  // the process ends when the faulting instruction runs again).
  if (g_previous.sa_flags & SA_SIGINFO) {
    g_previous.sa_sigaction(signal, info, context);
  } else if (g_previous.sa_handler != SIG_DFL &&
             g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(signal);
  } else {
    sigaction(SIGBUS, &g_previous, nullptr);
  }
}

void Install() {
  struct sigaction action = {};
  action.sa_sigaction = OnSigbus;
  // SA_NODEFER: the jump leaves the handler without returning, so SIGBUS
  // must not stay blocked (a second fault while blocked kills the process).
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, &g_previous);
}

}  // namespace

bool ReadMapped(absl::FunctionRef<void()> read) {
  static std::once_flag installed;
  std::call_once(installed, Install);
  sigjmp_buf landing;
  sigjmp_buf* const outer = t_landing;
  if (sigsetjmp(landing, 0) != 0) {
    t_landing = outer;
    return false;
  }
  t_landing = &landing;
  read();
  t_landing = outer;
  return true;
}

}  // namespace scalai
