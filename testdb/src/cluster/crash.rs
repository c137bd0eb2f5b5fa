//! Crashing a private cluster's server and starting it again: the database
//! failing under a running service, for fault tests.

use std::process::Child;
use std::time::{Duration, Instant};

use super::{Cluster, EXIT_TIMEOUT};
use crate::error::Error;
use crate::postgres::StopMode;

impl Cluster {
    /// Stops the server as a crash would (`pg_ctl stop -m immediate`: every
    /// server process ends at once, without a shutdown checkpoint, so the
    /// next start runs crash recovery) and waits until it has exited.
    /// Open sessions are cut; nothing accepts connections on
    /// [`port`](Self::port) until [`start_again`](Self::start_again).
    ///
    /// Blocks the current thread (about a second); from async code, call it
    /// through `tokio::task::spawn_blocking`. A server already stopped is
    /// left as it is.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_inbox_testdb::Cluster;
    ///
    /// let cluster = std::sync::Arc::new(Cluster::builder().start().await?);
    /// let c = cluster.clone();
    /// tokio::task::spawn_blocking(move || -> Result<(), tower_inbox_testdb::Error> {
    ///     c.crash()?;
    ///     c.start_again() // recovers, on the same port
    /// })
    /// .await??;
    /// # Ok(())
    /// # }
    /// ```
    pub fn crash(&self) -> Result<(), Error> {
        let instance = &self.instance;
        let mut server = instance.server.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut child) = server.take() else {
            return Ok(());
        };
        // Only a server that still runs: see `Instance::stop`.
        if matches!(child.try_wait(), Ok(None)) {
            if let Err(err) = instance.pg.stop(&instance.dirs, StopMode::Immediate) {
                *server = Some(child);
                return Err(err);
            }
        }
        wait_for_exit(&mut child);
        Ok(())
    }

    /// Kills the server's postmaster with SIGKILL, as the kernel's OOM
    /// killer or a lost machine would end it: no process of the server gets
    /// to do anything more than notice, and its sessions go when its other
    /// processes do. Waits until the postmaster has exited. Unlike
    /// [`crash`](Self::crash), the server is not meant to start again here:
    /// for a failover test (see [`standby`](Self::standby)).
    ///
    /// Blocks the current thread; a server already stopped is left as it is.
    pub fn kill(&self) -> Result<(), Error> {
        let instance = &self.instance;
        let mut server = instance.server.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut child) = server.take() else {
            return Ok(());
        };
        let pid_file = instance.dirs.data.join("postmaster.pid");
        // Only a server that still runs, and only the pid of one that works in its own data
        // directory: never a recycled pid.
        if matches!(child.try_wait(), Ok(None)) && super::server_runs_in(&instance.dirs.data) {
            let pid = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|text| text.lines().next().map(|l| l.trim().to_owned()))
                .ok_or_else(|| Error::msg(format!("cannot read {}", pid_file.display())))?;
            let status = std::process::Command::new("kill")
                .args(["-KILL", &pid])
                .status()
                .map_err(|e| Error::with_source("cannot run kill", e))?;
            if !status.success() {
                *server = Some(child);
                return Err(Error::msg(format!("`kill -KILL {pid}` failed ({status})")));
            }
        }
        wait_for_exit(&mut child);
        Ok(())
    }

    /// Starts the server again after [`crash`](Self::crash), with the same
    /// settings and on the same port, and waits until it accepts sessions
    /// (crash recovery included). A server that runs is left as it is.
    ///
    /// Blocks the current thread, like [`crash`](Self::crash). Fails if
    /// another process took the port meanwhile, or if the server does not
    /// come up; the error quotes its log.
    pub fn start_again(&self) -> Result<(), Error> {
        let instance = &self.instance;
        let mut server = instance.server.lock().unwrap_or_else(|e| e.into_inner());
        if server.is_some() {
            return Ok(());
        }
        let (launch, port) = instance
            .launch
            .as_ref()
            .ok_or_else(|| Error::msg("the cluster was never started"))?;
        *server = Some(instance.pg.start_again(&instance.dirs, launch, *port)?);
        Ok(())
    }
}

/// Waits until the server's process (or its runner) has exited, up to
/// [`EXIT_TIMEOUT`], then kills it.
fn wait_for_exit(child: &mut Child) {
    let deadline = Instant::now() + EXIT_TIMEOUT;
    while matches!(child.try_wait(), Ok(None)) {
        if Instant::now() >= deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.wait();
}

#[cfg(test)]
mod tests {
    use sqlx::{Connection, PgConnection};

    use crate::Cluster;

    /// What a crash keeps: a committed row survives crash recovery, and the
    /// server is back on its port.
    #[tokio::test]
    async fn a_crashed_cluster_starts_again_with_its_committed_data() {
        let cluster = std::sync::Arc::new(Cluster::builder().start().await.expect("cluster"));
        let db = cluster.database().await.expect("database");
        let mut conn = PgConnection::connect(db.url()).await.expect("connect");
        sqlx::raw_sql("create table t (n int); insert into t values (1)")
            .execute(&mut conn)
            .await
            .expect("write");

        let c = cluster.clone();
        tokio::task::spawn_blocking(move || c.crash())
            .await
            .unwrap()
            .expect("crash");
        let cut = sqlx::query("select 1").execute(&mut conn).await;
        assert!(cut.is_err(), "the session survived the crash");
        assert!(PgConnection::connect(db.url()).await.is_err());

        let c = cluster.clone();
        tokio::task::spawn_blocking(move || c.start_again())
            .await
            .unwrap()
            .expect("start again");
        let mut conn = PgConnection::connect(db.url()).await.expect("reconnect");
        let n: i32 = sqlx::query_scalar("select n from t")
            .fetch_one(&mut conn)
            .await
            .expect("read");
        assert_eq!(n, 1);
        let log = cluster.log().expect("log");
        assert!(
            log.contains("database system was interrupted")
                || log.contains("not properly shut down"),
            "no crash recovery in the log:\n{log}"
        );
    }
}
