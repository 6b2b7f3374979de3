//! PLACEHOLDER — replaced by the web branch.
use std::net::SocketAddr;
use std::sync::Arc;

use crate::am::status::StatusHub;

pub async fn serve(
    _hub: Arc<StatusHub>,
    listen: SocketAddr,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let l = tokio::net::TcpListener::bind(listen).await?;
    let addr = l.local_addr()?;
    let h = tokio::spawn(async move {
        let _ = axum::serve(l, axum::Router::new()).await;
    });
    Ok((addr, h))
}
