//! The HTTP listener of `ironsan serve --metrics ADDR:PORT`: Prometheus `/metrics`, a
//! read-only status page at `/` and its data at `/api/status`. axum routes the requests;
//! hyper (through hyper-util) speaks HTTP/1.1.
//!
//! The listener is for operators and scrapers, not the data path, and it is bounded so that a
//! misbehaving client cannot cost the target more than a little: at most
//! [`MAX_HTTP_CONNECTIONS`] connections at once (more are closed at once), one request per
//! connection (no keep-alive), a request head of at most 8 KiB (hyper answers 431 beyond),
//! and [`HTTP_TIMEOUT`] for the whole exchange. Nothing it serves changes state.

use crate::control::Control;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// Connections served at once; more are closed at once.
pub const MAX_HTTP_CONNECTIONS: usize = 8;
/// A connection must send its request and take the answer within this time.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request head hyper buffers (its minimum); a longer one gets 431.
const MAX_HTTP_HEAD: usize = 8 << 10;

/// The status page: static HTML and script that polls `/api/status`.
const STATUS_PAGE: &str = include_str!("status.html");

/// The routes, with `control` as their state.
pub fn router(control: Control) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/", get(status_page))
        .route("/api/status", get(status))
        .fallback(not_found)
        .with_state(control)
}

async fn metrics(State(control): State<Control>) -> Response {
    // Reads /proc and formats a few thousand lines: off the runtime threads.
    match tokio::task::spawn_blocking(move || crate::exposition::prometheus(&control)).await {
        Ok(body) => (
            [(header::CONTENT_TYPE, crate::exposition::CONTENT_TYPE)],
            body,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn status_page() -> Html<&'static str> {
    Html(STATUS_PAGE)
}

async fn status(State(control): State<Control>) -> Response {
    let view = tokio::task::spawn_blocking(move || {
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "targets": control.targets(),
            "luns": control.luns(None).unwrap_or_default(),
            "sessions": control.sessions(),
            "portals": control.portals(),
            "stats": control.stats(None).unwrap_or_default(),
        })
    })
    .await;
    match view {
        Ok(v) => ([(header::CACHE_CONTROL, "no-store")], axum::Json(v)).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn not_found() -> (StatusCode, &'static str) {
    (
        StatusCode::NOT_FOUND,
        "not found: try GET /metrics, / (status page) or /api/status\n",
    )
}

/// Serve [`router`] on `listener` until the task is dropped or aborted.
pub async fn serve(listener: tokio::net::TcpListener, control: Control) {
    let app = router(control);
    let limit = Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CONNECTIONS));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(permit) = Arc::clone(&limit).try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .max_buf_size(MAX_HTTP_HEAD)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
            let _ = tokio::time::timeout(HTTP_TIMEOUT, conn).await;
            drop(permit);
        });
    }
}
