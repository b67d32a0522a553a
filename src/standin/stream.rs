//! Decoding: each output token leaves as the model's engine makes it (one decode step each,
//! longer when other slots' prompts share the batch), as its own body chunk flushed as it is
//! produced, so a proxy in front sees time to first token and streaming exactly as with a
//! real Ollama. Also where a `CutMidStream` fault breaks the body.
//!
//! The body is a lazy stream that owns the generation: if the client goes away or the node
//! stops, hyper drops the stream and with it the slot and model leases.

use std::collections::VecDeque;
use std::io;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;

use super::generate::Generation;
use super::wire::Wire;

/// Pause before breaking a body, so the chunks sent before the cut reach the client.
const CUT_FLUSH_DELAY: Duration = Duration::from_millis(5);

/// The response for a prepared generation, streamed or whole.
pub async fn respond(generation: Generation) -> Response {
    let content_type = generation.wire.content_type(generation.stream);
    let body = if generation.stream {
        streamed_body(generation)
    } else {
        whole_body(generation).await
    };
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// A non-streamed reply: decode all tokens, then send one JSON object (headers included
/// only then, as Ollama does).
async fn whole_body(mut generation: Generation) -> Body {
    while generation.run.next_token().await {}
    let cut_after = generation.cut_after;
    let wire = generation.wire.clone();
    let text = generation.tokens.concat();
    let stats = generation.finish();
    let json = wire.whole(&text, &stats);
    match cut_after {
        None => Body::from(json),
        Some(n) => Body::from_stream(cut_whole(json, n)),
    }
}

/// A whole reply broken by a cut fault: nothing for a cut after 0 chunks, else half the
/// JSON; then, once that has reached the wire, the error that makes hyper drop the
/// connection.
fn cut_whole(json: Bytes, cut_after: u32) -> impl futures::Stream<Item = io::Result<Bytes>> {
    let sent = (cut_after > 0).then(|| Ok(json.slice(..json.len() / 2)));
    let cut = async {
        tokio::time::sleep(CUT_FLUSH_DELAY).await;
        Err(cut_error())
    };
    futures::stream::iter(sent).chain(futures::stream::once(cut))
}

/// A streamed reply: one chunk per token, then the trailer chunks.
fn streamed_body(generation: Generation) -> Body {
    let opening = generation.wire.opening().into();
    let decoder = Decoder {
        opening,
        wire: generation.wire.clone(),
        cut_after: generation.cut_after,
        generation: Some(generation),
        next: 0,
        tail: VecDeque::new(),
        sent: 0,
        broken: false,
    };
    Body::from_stream(futures::stream::unfold(decoder, Decoder::step))
}

/// State of a streamed reply between chunks.
struct Decoder {
    wire: Wire,
    generation: Option<Generation>,
    /// Index of the next token to send.
    next: usize,
    /// Events some APIs send before the first token, sent at once.
    opening: VecDeque<Bytes>,
    /// Trailer chunks still to send once decoding is over.
    tail: VecDeque<Bytes>,
    sent: u32,
    cut_after: Option<u32>,
    broken: bool,
}

impl Decoder {
    async fn step(mut self) -> Option<(io::Result<Bytes>, Self)> {
        if self.broken {
            return None;
        }
        if self.cut_after == Some(self.sent) {
            tokio::time::sleep(CUT_FLUSH_DELAY).await;
            self.generation = None;
            self.broken = true;
            return Some((Err(cut_error()), self));
        }
        let chunk = self.next_chunk().await?;
        self.sent += 1;
        Some((Ok(chunk), self))
    }

    /// The next token once its decode time has come, else the next trailer chunk.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        if let Some(opening) = self.opening.pop_front() {
            return Some(opening);
        }
        if let Some(generation) = &mut self.generation {
            if let Some(token) = generation.tokens.get(self.next) {
                let chunk = self.wire.token_at(self.next, token);
                generation.run.next_token().await;
                self.next += 1;
                return Some(chunk);
            }
            if let Some(generation) = self.generation.take() {
                let text = generation.tokens.concat();
                let tokens = generation.tokens.len();
                let stats = generation.finish();
                self.tail = self.wire.trailer_of(&stats, &text, tokens).into();
            }
        }
        self.tail.pop_front()
    }
}

fn cut_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "injected fault: cut mid-stream",
    )
}
