//! The credits example as a process of its own: started, SIGKILLed, started again on the
//! same address, so that the clients' retries find it there.

use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What the example logs once it serves.
const LISTENING: &str = "credits service listening";

/// The credits example on `database_url`, delivering its webhooks to `webhook`.
pub struct Service {
    binary: PathBuf,
    env: Vec<(&'static str, String)>,
    addr: SocketAddr,
    log: PathBuf,
    child: Option<Child>,
    /// How many times it was started.
    pub starts: usize,
}

impl Service {
    pub fn new(name: &str, database_url: &str, webhook: &str) -> Self {
        // A port that was free: the service binds it on every start (tokio sets SO_REUSEADDR,
        // so a killed predecessor's connections in TIME_WAIT do not keep it out).
        let addr = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port");
        let log = std::env::temp_dir().join(format!(
            "tower-inbox-faults-{name}-{}.log",
            std::process::id()
        ));
        Self {
            binary: crate::common::example::binary("credits"),
            env: vec![
                ("DATABASE_URL", database_url.to_owned()),
                ("BIND_ADDR", addr.to_string()),
                ("CREDITS_WEBHOOK_URL", webhook.to_owned()),
                // A killed process's leases then expire in 11 s, and the settle period
                // stays short.
                ("CREDITS_WEBHOOK_TIMEOUT_MS", "1000".to_owned()),
                ("RUST_LOG", "warn,credits=info".to_owned()),
                ("NO_COLOR", "1".to_owned()),
            ],
            addr,
            log,
            child: None,
            starts: 0,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Starts the process and waits (bounded) until it serves: its log says it listens.
    pub async fn start(&mut self) {
        assert!(self.child.is_none(), "the service is running already");
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("the service's log file");
        let mut command = Command::new(&self.binary);
        command
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        let mut child = command.spawn().expect("start the credits example");
        self.starts += 1;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if self.log_text().matches(LISTENING).count() >= self.starts {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "the credits example exited ({status}) before listening; its log:\n{}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the credits example did not listen on {} within 60 s; its log:\n{}",
                self.addr,
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.child = Some(child);
    }

    /// SIGKILL: the process ends wherever it is, its transactions cut mid-flight.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.log);
    }
}
