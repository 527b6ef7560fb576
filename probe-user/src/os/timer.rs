//! Timers for the drain's turns that wake probe once per deadline: a timerfd the kernel keeps,
//! read through tokio's reactor. A tokio timer more than 64 ms out wakes its thread twice (at the
//! coarse slot of its wheel, then at the exact time): the once-a-second turn cost two wake-ups a
//! second, each tens of µs on a VM, most of an idle trace's cost. tokio's timer stands in where
//! no timerfd can be made.
//!
//! Root-safe: nothing here touches a path; the descriptor is probe's own, close-on-exec.
use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::Duration,
};

use tokio::io::{Interest, unix::AsyncFd};

pub enum Timer {
    Kernel(AsyncFd<OwnedFd>),
    /// The next deadline (None: disarmed) and the period (zero: once).
    Tokio(Option<tokio::time::Instant>, Duration),
}

impl Default for Timer {
    fn default() -> Timer {
        Timer::new()
    }
}

impl Timer {
    /// A disarmed timer: a timerfd, else tokio's.
    pub fn new() -> Timer {
        // SAFETY: plain syscall; the descriptor is owned below.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
        if fd >= 0 {
            // SAFETY: fd was just made and is owned by nothing else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: the OwnedFd, moved into the AsyncFd, keeps the timerfd open and the same for
            // as long as the AsyncFd lives.
            match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
                Ok(fd) => return Timer::Kernel(fd),
                Err(e) => log::debug!("timerfd not pollable ({e}): tokio timers"),
            }
        } else {
            log::debug!("no timerfd ({}): tokio timers", std::io::Error::last_os_error());
        }
        Timer::Tokio(None, Duration::ZERO)
    }

    /// Expire in `first` (at once when zero), then every `every` (zero: only once). Replaces what
    /// was set, and drops expiries not waited for yet.
    pub fn set(&mut self, first: Duration, every: Duration) {
        match self {
            Timer::Kernel(fd) => {
                let ts = |d: Duration| libc::timespec { tv_sec: d.as_secs() as libc::time_t, tv_nsec: d.subsec_nanos() as libc::c_long };
                // A zero first expiry would disarm it.
                let spec = libc::itimerspec { it_value: ts(first.max(Duration::from_nanos(1))), it_interval: ts(every) };
                // SAFETY: our timerfd and a valid itimerspec; the old value is not asked for.
                if unsafe { libc::timerfd_settime(fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) } != 0 {
                    log::warn!("timerfd_settime: {}: tokio timers", std::io::Error::last_os_error());
                    *self = Timer::Tokio(Some(tokio::time::Instant::now() + first), every);
                }
            }
            Timer::Tokio(at, period) => {
                *at = Some(tokio::time::Instant::now() + first);
                *period = every;
            }
        }
    }

    /// The next expiry (expiries missed meanwhile count as one); never, while disarmed.
    pub async fn wait(&mut self) {
        match self {
            Timer::Kernel(fd) => loop {
                let Ok(mut ready) = fd.readable().await else { return std::future::pending().await };
                let mut count = 0u64;
                // SAFETY: an 8-byte read into a local from our timerfd.
                let n = unsafe { libc::read(fd.as_raw_fd(), (&raw mut count).cast(), 8) };
                if n == 8 {
                    return;
                }
                ready.clear_ready();
            },
            Timer::Tokio(at, period) => {
                let Some(deadline) = *at else { return std::future::pending().await };
                tokio::time::sleep_until(deadline).await;
                // The next on the period's grid after now (missed ones count as this one).
                *at = (!period.is_zero()).then(|| {
                    let (now, mut next) = (tokio::time::Instant::now(), deadline + *period);
                    while next <= now {
                        next += *period;
                    }
                    next
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both kinds: a periodic timer expires at once, then a period later; missed expiries count
    /// once; a one-shot timer expires once and a disarmed one never.
    #[test]
    fn expires_when_set_and_only_then() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            for mut t in [Timer::new(), Timer::Tokio(None, Duration::ZERO)] {
                let never = tokio::time::timeout(Duration::from_millis(30), t.wait()).await;
                assert!(never.is_err(), "a disarmed timer does not expire");
                // A 200 ms period, so that the checks below keep 150 ms of margin on a loaded box.
                t.set(Duration::ZERO, Duration::from_millis(200));
                let start = std::time::Instant::now();
                t.wait().await;
                assert!(start.elapsed() < Duration::from_millis(150), "at once");
                t.wait().await;
                let one = start.elapsed();
                assert!(one >= Duration::from_millis(190) && one < Duration::from_secs(2), "a period later: {one:?}");
                // Three periods and a quarter missed (from ~200 ms to ~850 ms): one expiry at
                // once, then the next on its period (~1000 ms), not at once again.
                std::thread::sleep(Duration::from_millis(650));
                t.wait().await;
                let late = std::time::Instant::now();
                t.wait().await;
                assert!(late.elapsed() >= Duration::from_millis(50), "missed expiries counted once: {:?}", late.elapsed());
                t.set(Duration::from_millis(20), Duration::ZERO);
                t.wait().await;
                let again = tokio::time::timeout(Duration::from_millis(60), t.wait()).await;
                assert!(again.is_err(), "a one-shot timer expires once");
            }
        });
    }
}
