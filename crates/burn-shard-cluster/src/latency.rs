//! The round trip between two nodes as built ([`Cluster::round_trip`]): the latency term of a
//! step-time model, measured rather than assumed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::cluster::Cluster;
use crate::error::ClusterError;

/// Longest any one wait of a measurement may take.
const LIMIT: Duration = Duration::from_secs(10);

impl Cluster {
    /// The median round trip of a 1-byte message over TCP (`TCP_NODELAY`) from node `from` to
    /// node `to` and back, over `samples` round trips on one connection (after one that is
    /// not counted: it also resolves the neighbour's address). Half of it is the one-way
    /// latency `α` of the alpha-beta model; it includes both kernels' TCP stacks, as every
    /// collective's message does.
    ///
    /// # Errors
    /// [`ClusterError::Invalid`] for 0 samples; [`ClusterError::Io`] when a node cannot be
    /// entered, or a connection fails or stalls for 10 s (a cut link).
    ///
    /// # Panics
    /// When a node is not a node of this cluster, or `from == to`.
    pub fn round_trip(&self, from: usize, to: usize, samples: usize) -> Result<Duration, ClusterError> {
        assert!(from != to, "a round trip from node {from} to itself");
        if samples == 0 {
            return Err(ClusterError::Invalid(
                "a round trip of 0 samples: give 1 or more".into(),
            ));
        }
        let server: SocketAddr = (self.address(to), 0).into();
        // Set by the client when it gives up before connecting: the echo side stops waiting.
        let client_gone = AtomicBool::new(false);
        // Set once the client has the echo side's port: from then on its own error is the cause.
        let echo_started = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let (port_tx, port_rx) = std::sync::mpsc::channel();
            let (client_gone, echo_started) = (&client_gone, &echo_started);
            let echo = scope.spawn(move || -> Result<(), ClusterError> {
                self.enter(to)?;
                let listener = TcpListener::bind(server)?;
                port_tx.send(listener.local_addr()?.port()).ok();
                // Polled, so that a client that never connects ends this side too.
                listener.set_nonblocking(true)?;
                let started = Instant::now();
                let mut conn = loop {
                    match listener.accept() {
                        Ok((conn, _)) => break conn,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            if client_gone.load(Ordering::Relaxed) {
                                return Ok(());
                            }
                            if started.elapsed() >= LIMIT {
                                let why = format!("no connection from node {from} within {LIMIT:?}");
                                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, why).into());
                            }
                            std::thread::sleep(Duration::from_millis(2));
                        }
                        Err(e) => return Err(e.into()),
                    }
                };
                conn.set_nonblocking(false)?;
                conn.set_nodelay(true)?;
                conn.set_read_timeout(Some(LIMIT))?;
                let mut byte = [0u8; 1];
                for _ in 0..=samples {
                    conn.read_exact(&mut byte)?;
                    conn.write_all(&byte)?;
                }
                Ok(())
            });
            let client = scope.spawn(move || -> Result<Duration, ClusterError> {
                let port = port_rx
                    .recv_timeout(LIMIT)
                    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "the echo side did not start"))?;
                echo_started.store(true, Ordering::Relaxed);
                let connected = self
                    .enter(from)
                    .and_then(|()| Ok(TcpStream::connect_timeout(&(self.address(to), port).into(), LIMIT)?));
                let mut conn = connected.inspect_err(|_| client_gone.store(true, Ordering::Relaxed))?;
                conn.set_nodelay(true)?;
                conn.set_read_timeout(Some(LIMIT))?;
                let mut byte = [7u8; 1];
                let mut times = Vec::with_capacity(samples);
                for i in 0..=samples {
                    let started = Instant::now();
                    conn.write_all(&byte)?;
                    conn.read_exact(&mut byte)?;
                    if i > 0 {
                        times.push(started.elapsed());
                    }
                }
                times.sort();
                Ok(times.get(times.len() / 2).copied().unwrap_or_default())
            });
            let rtt = client.join().expect("the client thread does not panic");
            let echoed = echo.join().expect("the echo thread does not panic");
            match (rtt, echoed) {
                (Ok(rtt), Ok(())) => Ok(rtt),
                // The client never had a port: the echo side's error is the cause.
                (Err(_), Err(echo)) if !echo_started.load(Ordering::Relaxed) => Err(echo),
                (Err(client), _) => Err(client),
                (Ok(_), Err(echo)) => Err(echo),
            }
        })
    }
}
