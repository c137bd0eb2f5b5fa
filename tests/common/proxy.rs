//! A TCP proxy between a client and its server (the pool and PostgreSQL, a consumer and its
//! broker) that can cut a connection at a chosen message, or every open connection at once,
//! stall every open connection (half-open: nothing passes, nothing closes), and delay every
//! message: the network failing in the middle of the protocol, on purpose.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

/// When an armed proxy cuts: before or after the matching message reaches the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// The server never sees the message (a `COMMIT` that never arrived: rolled back).
    Before,
    /// The server gets the message but its answer never comes back (a `COMMIT` that
    /// committed, unbeknown to the client).
    After,
    /// Nothing passes any more, the message included, and nothing closes: the connection
    /// goes half-open at that message (a `COMMIT` that never arrives, and no one is told).
    Stall,
}

struct Armed {
    pattern: Vec<u8>,
    cut: Cut,
    /// Cut every connection that sends the pattern, not only the next one.
    always: bool,
}

/// Forwards connections to `upstream` until dropped.
pub struct Proxy {
    addr: SocketAddr,
    armed: Arc<Mutex<Option<Armed>>>,
    cuts: Arc<Notify>,
    /// Bumped by [`cut_all`](Proxy::cut_all): every relay open at the time ends.
    generation: watch::Sender<u64>,
    /// Bumped by [`stall_all`](Proxy::stall_all): every relay open at the time stalls.
    stalls: watch::Sender<u64>,
    accepted: Arc<AtomicUsize>,
    /// Microseconds every chunk waits before it is passed on, either way.
    latency: Arc<AtomicU64>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let armed: Arc<Mutex<Option<Armed>>> = Arc::default();
        let cuts = Arc::new(Notify::new());
        let (generation, _) = watch::channel(0u64);
        let (stalls, _) = watch::channel(0u64);
        let accepted = Arc::new(AtomicUsize::new(0));
        let latency = Arc::new(AtomicU64::new(0));
        let (a, c, g, s, n, l) = (
            armed.clone(),
            cuts.clone(),
            generation.clone(),
            stalls.clone(),
            accepted.clone(),
            latency.clone(),
        );
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                n.fetch_add(1, Ordering::SeqCst);
                let mut killed = g.subscribe();
                let stalled = s.subscribe();
                let relay = relay(client, server, a.clone(), c.clone(), l.clone(), stalled);
                tokio::spawn(async move {
                    tokio::select! {
                        () = relay => {}
                        _ = killed.changed() => {}
                    }
                });
            }
        });
        Self {
            addr,
            armed,
            cuts,
            generation,
            stalls,
            accepted,
            latency,
        }
    }

    /// A proxy in front of the PostgreSQL server `options` name.
    pub async fn in_front_of(options: &sqlx::postgres::PgConnectOptions) -> Self {
        let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
            .await
            .expect("resolve the database server")
            .next()
            .expect("an address of the database server");
        Self::start(upstream).await
    }

    /// Delays every chunk of data by `latency` before passing it on, both ways, on every
    /// connection from now on; `Duration::ZERO` stops delaying.
    pub fn set_latency(&self, latency: std::time::Duration) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.latency.store(micros, Ordering::SeqCst);
    }

    /// Ends every connection open now, both ways, as a broken network or a restarted peer
    /// would, and returns how many that was; connections made afterwards are forwarded as
    /// before.
    pub fn cut_all(&self) -> usize {
        let open = self.generation.receiver_count();
        self.generation.send_modify(|g| *g += 1);
        open
    }

    /// Stops forwarding on every connection open now, both ways, without closing either
    /// side: a half-open connection, as after a network partition or a peer host that
    /// vanished, where neither end hears of it. Returns how many that was; the sockets stay
    /// open until [`cut_all`](Self::cut_all) or the end of the test, and connections made
    /// afterwards are forwarded as before.
    pub fn stall_all(&self) -> usize {
        let open = self.stalls.receiver_count();
        self.stalls.send_modify(|g| *g += 1);
        open
    }

    /// How many connections the proxy has forwarded so far: more than the client opened at
    /// first means it reconnected.
    pub fn connections(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the next connection that sends a message containing `pattern`.
    pub fn arm(&self, pattern: &[u8], cut: Cut) {
        *self.armed.lock().unwrap() = Some(Armed {
            pattern: pattern.to_vec(),
            cut,
            always: false,
        });
    }

    /// Cuts every connection that sends a message containing `pattern`, until disarmed.
    pub fn arm_always(&self, pattern: &[u8], cut: Cut) {
        *self.armed.lock().unwrap() = Some(Armed {
            pattern: pattern.to_vec(),
            cut,
            always: true,
        });
    }

    /// Cuts nothing more.
    pub fn disarm(&self) {
        *self.armed.lock().unwrap() = None;
    }

    /// Waits (bounded) until an armed cut has happened.
    pub async fn cut_done(&self) {
        tokio::time::timeout(std::time::Duration::from_secs(30), self.cuts.notified())
            .await
            .expect("the armed message never went through the proxy");
    }
}

async fn relay(
    mut client: TcpStream,
    mut server: TcpStream,
    armed: Arc<Mutex<Option<Armed>>>,
    cuts: Arc<Notify>,
    latency: Arc<AtomicU64>,
    mut stalled: watch::Receiver<u64>,
) {
    let delay = || async {
        let micros = latency.load(Ordering::SeqCst);
        if micros > 0 {
            tokio::time::sleep(std::time::Duration::from_micros(micros)).await;
        }
    };
    let (mut client_read, mut client_write) = client.split();
    let (mut server_read, mut server_write) = server.split();
    // Set once this connection is to be cut: `Before` ends it at once; `After` ends it when
    // the server answers the message, without passing the answer on.
    let cutting: Mutex<Option<Cut>> = Mutex::new(None);
    let to_server = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let chunk = &buf[..n];
            let cut = {
                let mut armed = armed.lock().unwrap();
                match &*armed {
                    Some(a) if a.always && contains(chunk, &a.pattern) => Some(a.cut),
                    Some(a) if contains(chunk, &a.pattern) => armed.take().map(|a| a.cut),
                    _ => None,
                }
            };
            if cut.is_some() {
                *cutting.lock().unwrap() = cut;
            }
            if cut == Some(Cut::Stall) {
                cuts.notify_one();
                std::future::pending::<()>().await;
            }
            delay().await;
            if cut == Some(Cut::Before) || server_write.write_all(chunk).await.is_err() {
                return;
            }
        }
    };
    let to_client = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // Zero once the server's side has ended.
            let n = server_read.read(&mut buf).await.unwrap_or(0);
            let cut = *cutting.lock().unwrap();
            match cut {
                Some(Cut::After) => return,
                // Half-open at the armed message: even the server's end is not passed on.
                Some(Cut::Stall) => std::future::pending::<()>().await,
                _ if n == 0 => return,
                _ => {}
            }
            delay().await;
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let stalls = tokio::select! {
        () = to_server => false,
        () = to_client => false,
        _ = stalled.changed() => true,
    };
    if stalls {
        // Half-open: both sockets stay open and nothing is read or written any more. Its
        // receiver goes, so the next stall counts only connections still forwarding.
        drop(stalled);
        std::future::pending::<()>().await;
    }
    // Either side ending ends both: the connection is gone for the client.
    drop(client);
    drop(server);
    if cutting.lock().unwrap().is_some() {
        cuts.notify_one();
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}
