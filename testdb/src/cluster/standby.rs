//! A streaming standby of a private cluster, and its promotion: the two
//! servers of a failover test.

use std::fs;
use std::os::unix::fs::DirBuilderExt;

use sqlx::{Connection, PgConnection};

use super::{Cluster, Instance};
use crate::error::{Context, Error};
use crate::postgres::Postgres;

impl Cluster {
    /// Creates a streaming standby of this cluster and starts it on a port of
    /// its own: `pg_basebackup -R -X stream` from this server, so the copy
    /// follows it, with the same settings. It serves reads until
    /// [`promote`](Self::promote)d. Databases created here before the copy
    /// are on it too.
    ///
    /// A synchronous standby is a setting of this (the primary) cluster:
    /// `ALTER SYSTEM SET synchronous_standby_names = '*'` and
    /// `pg_reload_conf()`, once the standby runs.
    ///
    /// Blocks the current thread (seconds: a base backup); from async code,
    /// call it through `tokio::task::spawn_blocking`.
    pub fn standby(&self) -> Result<Cluster, Error> {
        let primary = &self.instance;
        let (launch, _) = primary
            .launch
            .as_ref()
            .ok_or_else(|| Error::msg("the cluster was never started"))?;
        let pg = Postgres::find(crate::postgres::effective_uid()?)?;
        let mut instance = Instance::create(pg)?;
        let dirs = &instance.dirs;
        // The server user must own both, and pg_basebackup fills an empty one.
        for dir in [&dirs.data, &dirs.sock] {
            fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .context(|| format!("cannot create {}", dir.display()))?;
            instance.pg.give_to_server(dir)?;
        }
        let port = self.port.to_string();
        instance.pg.run_tool(
            "pg_basebackup",
            &[
                "-h".as_ref(),
                "127.0.0.1".as_ref(),
                "-p".as_ref(),
                port.as_ref(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "-D".as_ref(),
                dirs.data.as_os_str(),
                // standby.signal and primary_conninfo: it starts as this server's standby.
                "-R".as_ref(),
                "-X".as_ref(),
                "stream".as_ref(),
                "-c".as_ref(),
                "fast".as_ref(),
                "--no-sync".as_ref(),
            ],
            &dirs.base,
        )?;
        let port = instance.start_server(launch.clone())?;
        Cluster::of(instance, port)
    }

    /// Makes every commit on this (the primary) cluster wait until a standby
    /// has it (`synchronous_standby_names = '*'`), and waits (up to 30 s)
    /// until a [`standby`](Self::standby) is connected as synchronous. From
    /// then on, a commit that returned is on the standby too.
    pub async fn require_synchronous_standby(&self) -> Result<(), Error> {
        let url = self.server.maintenance_url();
        let mut conn = PgConnection::connect(url)
            .await
            .map_err(|e| Error::with_source("cannot connect to the primary", e))?;
        for sql in [
            "alter system set synchronous_standby_names = '*'",
            "select pg_catalog.pg_reload_conf()",
        ] {
            sqlx::raw_sql(sql)
                .execute(&mut conn)
                .await
                .map_err(|e| Error::with_source(format!("`{sql}` failed"), e))?;
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let sync: bool = sqlx::query_scalar(
                "select exists (select 1 from pg_catalog.pg_stat_replication \
                 where sync_state = 'sync')",
            )
            .fetch_one(&mut conn)
            .await
            .map_err(|e| Error::with_source("cannot read pg_stat_replication", e))?;
            if sync {
                let _ = conn.close().await;
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return Err(Error::msg(
                    "no standby became synchronous within 30 s (pg_stat_replication)",
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Promotes a [`standby`](Self::standby) to a primary (`pg_ctl promote
    /// -w`): it stops following and accepts writes once this returns.
    ///
    /// Blocks the current thread, like [`standby`](Self::standby).
    pub fn promote(&self) -> Result<(), Error> {
        let dirs = &self.instance.dirs;
        self.instance.pg.run_tool(
            "pg_ctl",
            &[
                "-D".as_ref(),
                dirs.data.as_os_str(),
                "-w".as_ref(),
                "promote".as_ref(),
            ],
            &dirs.base,
        )
    }
}

#[cfg(test)]
mod tests {
    use sqlx::{Connection, PgConnection};

    use crate::Cluster;

    /// What a failover needs: a committed row reaches the standby, and the
    /// promoted standby accepts writes after its primary was killed.
    #[tokio::test]
    async fn a_standby_follows_its_primary_and_takes_over_when_promoted() {
        let primary = std::sync::Arc::new(Cluster::builder().start().await.expect("primary"));
        let db = primary.database().await.expect("database");
        let p = primary.clone();
        let standby = tokio::task::spawn_blocking(move || p.standby())
            .await
            .unwrap()
            .expect("standby");
        primary
            .require_synchronous_standby()
            .await
            .expect("make the standby synchronous");
        let mut conn = PgConnection::connect(db.url()).await.expect("connect");
        // Committed only once the standby has it.
        sqlx::raw_sql("create table t (n int); insert into t values (1)")
            .execute(&mut conn)
            .await
            .expect("write");

        let p = primary.clone();
        tokio::task::spawn_blocking(move || p.kill())
            .await
            .unwrap()
            .expect("kill the primary");
        let standby = std::sync::Arc::new(standby);
        let s = standby.clone();
        tokio::task::spawn_blocking(move || s.promote())
            .await
            .unwrap()
            .expect("promote");
        let url = standby.server().database_url(db.name());
        let mut conn = PgConnection::connect(&url)
            .await
            .expect("connect to the standby");
        sqlx::query("insert into t values (2)")
            .execute(&mut conn)
            .await
            .expect("write on the promoted standby");
        let rows: i64 = sqlx::query_scalar("select count(*) from t")
            .fetch_one(&mut conn)
            .await
            .expect("read");
        assert_eq!(rows, 2);
    }
}
