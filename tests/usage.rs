//! Usage per client: tokens per `api_keys` name and model in Prometheus, read from each
//! API's usage object, and the key name in the access log.

mod common;

use common::*;
use serde_json::{Value, json};

/// The value of one sample of `corral_client_tokens_total`, 0 when absent.
fn tokens(scrape: &str, client: &str, kind: &str) -> u64 {
    let labels = format!(r#"client="{client}",kind="{kind}",model="{MODEL}""#);
    scrape
        .lines()
        .find(|l| l.starts_with("corral_client_tokens_total{") && l.contains(&labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn send(router: &Router, key: &str, path: &str, body: Value) -> String {
    let request = client().post(format!("{}{path}", router.url()));
    // Anthropic's clients send their key in x-api-key, the others as a bearer token.
    let request = match path {
        "/v1/messages" => request.header("x-api-key", key),
        _ => request.bearer_auth(key),
    };
    let resp = request.json(&body).send().await.expect("a reply");
    assert_eq!(resp.status(), 200, "{path}");
    resp.text().await.unwrap()
}

/// The usage a reply's own text reports: (prompt tokens, completion tokens).
fn reported(text: &str) -> (u64, u64) {
    let objects: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l.trim_start_matches("data: ")).ok())
        .collect();
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    for v in objects.iter().rev() {
        if v["prompt_eval_count"].is_u64() {
            return (n(&v["prompt_eval_count"]), n(&v["eval_count"]));
        }
        let usage = if v["usage"].is_object() {
            &v["usage"]
        } else {
            &v["response"]["usage"]
        };
        if usage["input_tokens"].is_u64() {
            return (n(&usage["input_tokens"]), n(&usage["output_tokens"]));
        }
        if usage["prompt_tokens"].is_u64() {
            return (n(&usage["prompt_tokens"]), n(&usage["completion_tokens"]));
        }
    }
    panic!("no usage in {text}");
}

#[tokio::test]
async fn tokens_are_counted_per_key_name_and_logged() {
    let node = start(fast_node("n0")).await;
    let metrics_port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let yaml = format!(
        "metrics_listen: 127.0.0.1:{metrics_port}\naccess_log: {}\n\
         api_keys: [plain-key, {{name: team-a, key: key-a}}, {{name: team-b, key: key-b}}]\n",
        log.display()
    );
    let router = Router::start(vec![NodeSpec::of(&node, 2)], &yaml).await;
    let user = |t: &str| json!([{ "role": "user", "content": t }]);

    // team-a: native chat streamed, Responses streamed, OpenAI chat with usage streamed.
    let mut team_a = (0, 0);
    for (path, body) in [
        (
            "/api/chat",
            json!({ "model": MODEL, "messages": user("one") }),
        ),
        (
            "/v1/responses",
            json!({ "model": MODEL, "input": "two", "stream": true }),
        ),
        (
            "/v1/chat/completions",
            json!({ "model": MODEL, "messages": user("three"), "stream": true,
                "stream_options": { "include_usage": true } }),
        ),
    ] {
        let (p, c) = reported(&send(&router, "key-a", path, body).await);
        team_a = (team_a.0 + p, team_a.1 + c);
    }
    // team-b: Anthropic, whole and streamed (usage in message_delta). The plain key:
    // anonymous.
    let body = json!({ "model": MODEL, "max_tokens": 3, "messages": user("four") });
    let whole = reported(&send(&router, "key-b", "/v1/messages", body).await);
    let body = json!({ "model": MODEL, "max_tokens": 2, "stream": true, "messages": user("4b") });
    let streamed = reported(&send(&router, "key-b", "/v1/messages", body).await);
    let team_b = (whole.0 + streamed.0, whole.1 + streamed.1);
    let body = json!({ "model": MODEL, "stream": false, "messages": user("five") });
    let anonymous = reported(&send(&router, "plain-key", "/api/chat", body).await);

    let mut scraped = String::new();
    eventually("the counters are scraped", async || {
        scraped = scrape(metrics_port).await;
        tokens(&scraped, "anonymous", "prompt") > 0
    })
    .await;
    assert!(team_a.0 > 0 && team_b.0 > 0, "{team_a:?} {team_b:?}");
    assert_eq!(tokens(&scraped, "team-a", "prompt"), team_a.0, "{scraped}");
    assert_eq!(tokens(&scraped, "team-a", "completion"), team_a.1);
    assert_eq!(tokens(&scraped, "team-b", "prompt"), team_b.0);
    assert_eq!(tokens(&scraped, "team-b", "completion"), 3 + 2);
    assert_eq!(tokens(&scraped, "anonymous", "prompt"), anonymous.0);
    // The OpenAI stream reported cached tokens (the stand-in's prefix cache): counted.
    assert!(
        scraped.contains(r#"client="team-a",kind="cached""#),
        "{scraped}"
    );

    let mut names = Vec::new();
    eventually("the access log is written", async || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        names = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .map(|v| v["key_name"].as_str().unwrap_or_default().to_string())
            .collect();
        names.len() >= 6
    })
    .await;
    assert_eq!(
        names,
        [
            "team-a",
            "team-a",
            "team-a",
            "team-b",
            "team-b",
            "anonymous"
        ],
        "one line per request, in order"
    );
}
