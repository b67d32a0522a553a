//! Operating corral: Prometheus metrics after real traffic, the admin API, the access log.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test]
async fn metrics_count_what_routing_did() {
    let mut cold = fast_node("cold");
    cold.preload.clear();
    cold.models.push(model("qwen2.5:0.5b", 0.4));
    let cold = start(cold).await;
    let warm = start(fast_node("warm")).await;
    let metrics_port = free_port();
    let router = Router::start(
        vec![NodeSpec::of(&cold, 2), NodeSpec::of(&warm, 2)],
        &format!("metrics_listen: 127.0.0.1:{metrics_port}\n"),
    )
    .await;

    let t1 = vec!["Hello, how are you today?".to_string()];
    let (_, _, reply) = chat(&router, &t1).await;
    let t2 = vec![t1[0].clone(), reply, "And tomorrow?".into()];
    let (_, affinity, _) = chat(&router, &t2).await;
    assert_eq!(affinity, "hit");
    // Only "cold" has this model, and not loaded: a cold load.
    let body = serde_json::json!({ "model": "qwen2.5:0.5b", "stream": false,
        "messages": [{ "role": "user", "content": "hi" }] });
    let resp = post_chat(&router, &body).await;
    assert_eq!(header(&resp, "x-fleet-node"), "cold");
    resp.bytes().await.unwrap();
    let resp = client()
        .post(format!("{}/api/chat", router.url()))
        .json(&serde_json::json!({ "model": "missing:1b", "messages": [] }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);

    // Requests are counted when Pingora logs them, just after the reply is sent.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let scrape = loop {
        let scrape = scrape(metrics_port).await;
        let counted: f64 = scrape
            .lines()
            .filter(|l| l.starts_with("corral_requests_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if counted >= 4.0 || std::time::Instant::now() > deadline {
            break scrape;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let get = |name: &str, labels: &[(&str, &str)]| sample(&scrape, name, labels);
    assert_eq!(
        get("corral_affinity_total", &[("result", "hit")]),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        get("corral_affinity_total", &[("result", "new")]),
        Some(2.0)
    );
    assert_eq!(
        get(
            "corral_cold_loads_total",
            &[("node", "cold"), ("model", "qwen2.5:0.5b")]
        ),
        Some(1.0)
    );
    assert_eq!(
        get("corral_model_loads_total", &[("node", "cold")]),
        Some(0.0),
        "a 50 ms load is under the 0.1 s threshold (the series exists from start)"
    );
    assert_eq!(
        get(
            "corral_requests_total",
            &[
                ("node", "warm"),
                ("endpoint", "/api/chat"),
                ("status", "200")
            ]
        ),
        Some(2.0)
    );
    assert_eq!(
        get(
            "corral_requests_total",
            &[("node", "none"), ("model", "other"), ("status", "404")]
        ),
        Some(1.0),
        "an unknown model does not become a label"
    );
    assert_eq!(
        get(
            "corral_time_to_first_token_seconds_count",
            &[("node", "warm")]
        ),
        Some(2.0)
    );
    assert!(
        get(
            "corral_prompt_tokens_total",
            &[("node", "warm"), ("kind", "evaluated")]
        )
        .unwrap()
            > 0.0
    );
    assert_eq!(get("corral_node_up", &[("node", "cold")]), Some(1.0));
    assert_eq!(
        get(
            "corral_model_resident",
            &[("node", "warm"), ("model", MODEL)]
        ),
        Some(1.0)
    );
    assert_eq!(
        get("corral_in_flight", &[("node", "warm"), ("model", MODEL)]),
        Some(0.0)
    );
    assert!(get("corral_affinity_entries", &[]).unwrap() >= 2.0);
    assert_eq!(get("corral_winning_score_count", &[]), Some(3.0));
}

#[tokio::test]
async fn admin_api_reports_the_fleet_and_explains_without_forwarding() {
    let a = start(fast_node("a")).await;
    let b = start(fast_node("b")).await;
    let admin_port = free_port();
    let router = Router::start(
        vec![NodeSpec::of(&a, 2), NodeSpec::of(&b, 2)],
        &format!("admin_listen: 127.0.0.1:{admin_port}\nadmin_token: s3cret\n"),
    )
    .await;
    let admin = |path: &str| format!("http://127.0.0.1:{admin_port}{path}");
    let c = client();

    let denied = c.get(admin("/fleet")).send().await.unwrap();
    assert_eq!(denied.status(), 401);
    let wrong = c
        .get(admin("/fleet"))
        .bearer_auth("nope")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);

    let t = vec!["Tell me a story about a fleet".to_string()];
    let (node, _, reply) = chat(&router, &t).await;

    let fleet: serde_json::Value = c
        .get(admin("/fleet"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let nodes = fleet["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    let served = nodes.iter().find(|n| n["name"] == node.as_str()).unwrap();
    assert_eq!(served["healthy"], true);
    assert_eq!(served["resident"][0]["model"], MODEL);
    assert_eq!(
        served["models"][MODEL]["warm_slots"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert!(fleet["affinity_entries"].as_u64().unwrap() >= 1);

    let served_before: usize = a.log().len() + b.log().len();
    let follow_up = chat_body(&[t[0].clone(), reply, "more".into()], false);
    let table: serde_json::Value = c
        .post(admin("/explain"))
        .bearer_auth("s3cret")
        .json(&follow_up)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(table["winner"], node.as_str());
    assert_eq!(table["pin"]["node"], node.as_str());
    let candidates = table["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 2);
    assert_eq!(candidates[0]["affinity"], "hit");
    assert_eq!(candidates[0]["scores"]["session_affinity"], 20.0);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        a.log().len() + b.log().len(),
        served_before,
        "explain forwards nothing"
    );

    let bad = c
        .post(admin("/explain"))
        .bearer_auth("s3cret")
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);

    // A routing error is told as the proxy tells it (status and message), and the admin
    // token is read as the client keys are (surrounding blanks ignored).
    let mut unknown = chat_body(&["hi".to_string()], false);
    unknown["model"] = "nosuch:1b".into();
    let resp = c
        .post(admin("/explain"))
        .header("Authorization", "Bearer s3cret ")
        .json(&unknown)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"], "model 'nosuch:1b' not found");
}

#[tokio::test]
async fn access_log_writes_one_json_line_per_request() {
    let node = start(fast_node("n")).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.log");
    let router = Router::start(
        vec![NodeSpec::of(&node, 2)],
        &format!("access_log: {}\n", path.display()),
    )
    .await;
    chat(&router, &["one".into()]).await;
    let resp = client()
        .get(format!("{}/api/nothing", router.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);

    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let lines: Vec<serde_json::Value> = loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        if lines.len() >= 2 {
            break lines;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "access log has {} lines",
            lines.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let routed = &lines[0];
    assert_eq!(routed["endpoint"], "/api/chat");
    assert_eq!(routed["node"], "n");
    assert_eq!(routed["status"], 200);
    assert_eq!(routed["affinity"], "new");
    assert_eq!(routed["cold_load"], false);
    assert!(routed["ttfb_ms"].as_f64().unwrap() > 0.0);
    assert!(routed["duration_ms"].as_f64().unwrap() >= routed["ttfb_ms"].as_f64().unwrap());
    assert!(routed["bytes"].as_u64().unwrap() > 0);
    assert!(routed["client"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert_eq!(lines[1]["status"], 404);
    assert!(lines[1]["node"].is_null());
}
