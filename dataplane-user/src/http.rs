//! The agent's small HTTP servers (metrics and health; the egress IP lease's probes), each on
//! a thread and runtime of its own: a slow scrape, a stalled sync or a flood of connections
//! never delays another server or the agent's loop. Each server takes at most
//! [`CONNECTIONS_MAX`] connections at once (the rest wait in the listen backlog), gives a
//! client [`HEADER_TIMEOUT`] to send its request's head and [`CONNECTION_TIMEOUT`] in all.

use std::{convert::Infallible, net::SocketAddr, sync::Arc, time::Duration};

use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Bytes, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};

/// Connections served at once, per server.
pub const CONNECTIONS_MAX: usize = 64;
/// How long a client may take to send a request's head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection may last, requests and answers included.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// What a server answers: from the request (its method, path and query) and the client's
/// address. Synchronous: nothing a server answers waits on anything.
pub type Handler =
    dyn Fn(&Request<hyper::body::Incoming>, SocketAddr) -> Response<Full<Bytes>> + Send + Sync;

/// A response of `status` with a text or JSON body.
pub fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

/// Serves `handler` on `listener` from a thread of its own (named `name`) for as long as the
/// process runs.
pub fn spawn(
    name: &str,
    listener: std::net::TcpListener,
    handler: Arc<Handler>,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let thread_name = name.to_owned();
    std::thread::Builder::new()
        .name(thread_name.clone())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(error) => {
                    tracing::error!(server = thread_name, %error, "no runtime for the server");
                    return;
                }
            };
            runtime.block_on(serve(listener, handler, thread_name));
        })?;
    Ok(())
}

/// Serves `handler` on `listener` on the calling runtime until the task is dropped or aborted
/// (what [`spawn`] runs on a thread of its own).
pub async fn serve(listener: std::net::TcpListener, handler: Arc<Handler>, name: String) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(server = name, %error, "listener");
            return;
        }
    };
    let room = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    loop {
        let Ok(permit) = Arc::clone(&room).acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::debug!(server = name, %error, "accepting a connection");
                continue;
            }
        };
        let handler = Arc::clone(&handler);
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let response = handler(&request, peer);
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                Ok(Err(error)) => tracing::debug!(%error, "HTTP connection"),
                Err(_) => tracing::debug!(%peer, "HTTP connection cut at its time limit"),
                Ok(Ok(())) => {}
            }
            drop(permit);
        });
    }
}

/// Binds `address` (a taken port is an error naming it, before anything else starts).
pub fn bind(address: SocketAddr) -> Result<std::net::TcpListener, crate::error::AgentError> {
    std::net::TcpListener::bind(address)
        .map_err(|source| crate::error::AgentError::Listen { address, source })
}

/// What an HTTP scrape renders: the agent's or the controller's registry.
pub trait Exposition: Send + Sync {
    fn render(&self) -> Result<String, std::fmt::Error>;
}

impl<T: Exposition> Exposition for std::sync::Mutex<T> {
    fn render(&self) -> Result<String, std::fmt::Error> {
        self.lock().unwrap_or_else(|p| p.into_inner()).render()
    }
}
