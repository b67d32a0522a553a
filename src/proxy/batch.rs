//! Chunks of a reply that have already arrived together are sent to the client together.
//!
//! A node that streams fast (a short answer, or a burst after a pause) delivers many small
//! chunks in one read from its socket. Writing each to the client on its own costs one
//! system call per chunk; Pingora's own proxy loop batches what is ready, and so does
//! corral: after a chunk it waited for, it takes every chunk that is ready without waiting
//! and writes them as one. Nothing waits for more data, so a chunk is never held back.

use bytes::BytesMut;
use futures::FutureExt;
use pingora_core::Error;
use pingora_core::protocols::http::v1::client::HttpSession;

/// The most bytes gathered into one write; more that is ready goes in the next.
pub const MAX_BATCH: usize = 64 * 1024;

/// What reading the ready chunks ended on.
#[derive(Debug)]
pub enum Next {
    /// Nothing more has arrived yet (or the batch is full): wait for the next chunk.
    Wait,
    /// The reply's body is complete.
    End,
    /// Reading failed; what was gathered before the failure is still to be sent.
    Failed(Box<Error>),
}

/// Appends to `batch` the reply's chunks that are ready now, without waiting, until the body
/// ends or the batch holds [`MAX_BATCH`] bytes.
///
/// Pingora's body reader keeps its state across a read that is dropped while pending (its
/// own proxy loop drops such reads in `select!`), so polling a read once and dropping it
/// loses nothing: the next read starts where this one stopped.
pub fn read_ready(upstream: &mut HttpSession, batch: &mut BytesMut) -> Next {
    while batch.len() < MAX_BATCH {
        match upstream.read_body_ref().now_or_never() {
            None => return Next::Wait,
            Some(Ok(Some(chunk))) => batch.extend_from_slice(chunk),
            Some(Ok(None)) => return Next::End,
            Some(Err(e)) => return Next::Failed(e),
        }
    }
    Next::Wait
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora_core::protocols::l4::stream::Stream;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A client session that has read the header of a chunked reply, and the node's end of
    /// its socket.
    async fn reply_started() -> (HttpSession, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let mut node = accepted.unwrap().0;
        let mut upstream = HttpSession::new(Box::new(Stream::from(client.unwrap())));
        node.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            .await
            .unwrap();
        upstream.read_resp_header_parts().await.unwrap();
        (upstream, node)
    }

    fn chunk(text: &str) -> Vec<u8> {
        format!("{:X}\r\n{text}\r\n", text.len()).into_bytes()
    }

    #[tokio::test]
    async fn takes_every_chunk_already_arrived_and_the_end() {
        let (mut upstream, mut node) = reply_started().await;
        let lines: Vec<String> = (0..16).map(|i| format!("{{\"n\":{i}}}\n")).collect();
        let mut wire: Vec<u8> = lines.iter().flat_map(|l| chunk(l)).collect();
        wire.extend_from_slice(b"0\r\n\r\n");
        node.write_all(&wire).await.unwrap();

        let mut batch = BytesMut::new();
        let first = upstream.read_body_ref().await.unwrap().unwrap();
        batch.extend_from_slice(first);
        // Loopback delivers the whole write at once: everything is ready.
        let next = read_ready(&mut upstream, &mut batch);
        assert!(matches!(next, Next::End), "{next:?}");
        assert_eq!(batch, lines.concat().as_bytes());
    }

    #[tokio::test]
    async fn stops_at_what_has_arrived_and_resumes_where_it_stopped() {
        let (mut upstream, mut node) = reply_started().await;
        // The second chunk's head arrives now, its data later: the pending read is dropped
        // mid-chunk and must resume there.
        let mut wire = chunk("first\n");
        wire.extend_from_slice(b"7\r\nsec");
        node.write_all(&wire).await.unwrap();

        let mut batch = BytesMut::new();
        let first = upstream.read_body_ref().await.unwrap().unwrap();
        batch.extend_from_slice(first);
        let next = read_ready(&mut upstream, &mut batch);
        assert!(matches!(next, Next::Wait), "{next:?}");
        // Whatever part of the second chunk was ready may have been taken; nothing is lost
        // or repeated once the rest comes.
        node.write_all(b"ond\n\r\n0\r\n\r\n").await.unwrap();
        while let Some(chunk) = upstream.read_body_ref().await.unwrap() {
            batch.extend_from_slice(chunk);
        }
        assert_eq!(batch, &b"first\nsecond\n"[..]);
    }

    #[tokio::test]
    async fn a_full_batch_waits_for_the_next_write() {
        let (mut upstream, mut node) = reply_started().await;
        let big = "x".repeat(MAX_BATCH / 4);
        let wire: Vec<u8> = (0..8).flat_map(|_| chunk(&big)).collect();
        let writer = tokio::spawn(async move {
            node.write_all(&wire).await.unwrap();
            node.write_all(b"0\r\n\r\n").await.unwrap();
            node
        });
        let mut batch = BytesMut::new();
        let mut total = 0;
        loop {
            let Some(first) = upstream.read_body_ref().await.unwrap() else {
                break;
            };
            batch.extend_from_slice(first);
            let next = read_ready(&mut upstream, &mut batch);
            assert!(batch.len() < MAX_BATCH + MAX_BATCH / 4 + 1, "bounded");
            total += batch.split().len();
            if matches!(next, Next::End) {
                break;
            }
        }
        assert_eq!(total, 8 * big.len());
        drop(writer.await.unwrap());
    }

    #[tokio::test]
    async fn a_broken_reply_keeps_what_came_before() {
        let (mut upstream, mut node) = reply_started().await;
        let mut wire = chunk("ok\n");
        wire.extend_from_slice(b"zz\r\nnot a chunk");
        node.write_all(&wire).await.unwrap();
        let mut batch = BytesMut::new();
        let first = upstream.read_body_ref().await.unwrap().unwrap();
        batch.extend_from_slice(first);
        let next = read_ready(&mut upstream, &mut batch);
        assert!(matches!(next, Next::Failed(_)), "{next:?}");
        assert_eq!(batch, &b"ok\n"[..]);
    }
}
