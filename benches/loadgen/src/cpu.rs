//! CPU time: the load generator's own (`getrusage`), and that of the server and of
//! PostgreSQL from `/proc` (Linux), taken before and after each phase.

use std::time::Duration;

/// CPU time so far of the load generator, and of the server and PostgreSQL where they are
/// measured; or, from [`since`](Self::since), the time used between two snapshots.
pub(crate) struct CpuTimes {
    pub(crate) own: Option<Duration>,
    pub(crate) server: Option<Duration>,
    pub(crate) postgres: Option<Duration>,
}

impl CpuTimes {
    /// The times now: the server's where `server_pid` is given, PostgreSQL's where `postgres`.
    pub(crate) fn now(server_pid: Option<u32>, postgres: bool) -> CpuTimes {
        CpuTimes {
            own: cpu_time(),
            server: server_pid.and_then(|pid| process_cpu(&[pid])),
            postgres: postgres.then(postgres_cpu).flatten(),
        }
    }

    /// The time used from `before` to these times.
    pub(crate) fn since(&self, before: &CpuTimes) -> CpuTimes {
        let used = |after: Option<Duration>, before: Option<Duration>| {
            after
                .zip(before)
                .map(|(after, before)| after.saturating_sub(before))
        };
        CpuTimes {
            own: used(self.own, before.own),
            server: used(self.server, before.server),
            postgres: used(self.postgres, before.postgres),
        }
    }
}

/// The process's user and system CPU time so far.
#[cfg(unix)]
fn cpu_time() -> Option<Duration> {
    // SAFETY: `rusage` is plain data, for which all zeroes is a valid value, and getrusage
    // only writes into the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return None;
        }
        usage
    };
    let time = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    Some(time(usage.ru_utime) + time(usage.ru_stime))
}

#[cfg(not(unix))]
fn cpu_time() -> Option<Duration> {
    None
}

/// The user and system CPU time the processes `pids` have used so far, from
/// `/proc/PID/stat` (Linux); `None` where it cannot be read. A process that exits during a
/// phase takes its time with it: the pool's connections (and so their backends) live on.
#[cfg(unix)]
fn process_cpu(pids: &[u32]) -> Option<Duration> {
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = u64::try_from(ticks).ok().filter(|t| *t > 0)?;
    let mut total = 0u64;
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The command name is in parentheses and may hold spaces: count after its end.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        // utime and stime are the 14th and 15th fields, the 12th and 13th after the name.
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        total += utime + stime;
    }
    Some(Duration::from_micros(total * 1_000_000 / ticks))
}

#[cfg(not(unix))]
fn process_cpu(_pids: &[u32]) -> Option<Duration> {
    None
}

/// The CPU time every process named `postgres` has used so far (Linux).
fn postgres_cpu() -> Option<Duration> {
    let pids: Vec<u32> = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid: &u32| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim_end() == "postgres")
        })
        .collect();
    // Processes that exit between the listing and the read are left out.
    let readable: Vec<u32> = pids
        .into_iter()
        .filter(|pid| process_cpu(&[*pid]).is_some())
        .collect();
    process_cpu(&readable)
}
