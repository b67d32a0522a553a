//! Changing corral while it runs: configuration reload, SIGTERM drain, graceful upgrade.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// Reads a streamed reply to its end and says whether Ollama's final chunk came.
async fn completed(resp: reqwest::Response) -> bool {
    let Ok(text) = resp.text().await else {
        return false;
    };
    text.lines()
        .last()
        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .is_some_and(|v| v["done"] == true)
}

async fn model_names(router: &Router) -> Vec<String> {
    let tags = get_json(&format!("{}/api/tags", router.url())).await;
    tags["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap().to_string())
        .collect()
}

fn node_with_qwen(name: &str) -> corral::standin::StandinConfig {
    let mut c = fast_node(name);
    c.models.push(model("qwen2.5:14b", 9.0));
    c.preload.push("qwen2.5:14b".into());
    c.decode_per_token = Duration::from_millis(20);
    c
}

#[tokio::test]
async fn sighup_adds_and_removes_nodes_without_dropping_streams() {
    let a = start(node_with_qwen("a")).await;
    let mut b_cfg = node_with_qwen("b");
    b_cfg.models.push(model("phi3:mini", 2.3));
    let b = start(b_cfg).await;
    let router = Router::start(vec![NodeSpec::of(&a, 4)], "").await;
    assert!(
        !model_names(&router)
            .await
            .contains(&"phi3:mini".to_string())
    );

    // 200 tokens at 20 ms: still streaming through both reloads below.
    let stream = hold(&router, "a long answer across the reload", 200).await;
    router.rewrite_config(&[NodeSpec::of(&a, 4), NodeSpec::of(&b, 4)], "");
    router.signal("HUP");
    eventually("b's models are listed", async || {
        model_names(&router)
            .await
            .contains(&"phi3:mini".to_string())
    })
    .await;
    let body = serde_json::json!({ "model": "phi3:mini", "stream": false,
        "messages": [{ "role": "user", "content": "hi" }] });
    let resp = post_chat(&router, &body).await;
    assert_eq!(
        (resp.status().as_u16(), header(&resp, "x-fleet-node")),
        (200, "b".to_string())
    );

    // Remove a: everything goes to b, and the stream a was serving still finishes.
    router.rewrite_config(&[NodeSpec::of(&b, 4)], "");
    router.signal("HUP");
    eventually("a is gone", async || {
        let (node, _, _) = chat(&router, &["who answers?".into()]).await;
        node == "b"
    })
    .await;
    for i in 0..4 {
        assert_eq!(chat(&router, &[format!("after {i}")]).await.0, "b");
    }
    assert!(
        completed(stream).await,
        "the stream in flight during both reloads completed"
    );
}

#[tokio::test]
async fn an_invalid_config_is_rejected_and_the_old_one_stays() {
    let a = start(fast_node("a")).await;
    let router = Router::start(vec![NodeSpec::of(&a, 2)], "").await;
    router.write_raw_config(
        "nodes:\n  - name: a\n    url: ftp://nowhere\nweights:\n  model_loded: 3\n",
    );
    router.signal("HUP");
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..3 {
        assert_eq!(chat(&router, &[format!("still {i}")]).await.0, "a");
    }
    // The process still reloads a valid file afterwards.
    let b = start(node_with_qwen("b")).await;
    router.rewrite_config(&[NodeSpec::of(&a, 2), NodeSpec::of(&b, 2)], "");
    router.signal("HUP");
    eventually("b's models are listed", async || {
        model_names(&router)
            .await
            .contains(&"qwen2.5:14b".to_string())
    })
    .await;
}

#[tokio::test]
async fn watched_config_reloads_on_change() {
    let a = start(fast_node("a")).await;
    let b = start(node_with_qwen("b")).await;
    let extra = "watch_config: 100ms\n";
    let router = Router::start(vec![NodeSpec::of(&a, 2)], extra).await;
    router.rewrite_config(&[NodeSpec::of(&a, 2), NodeSpec::of(&b, 2)], extra);
    eventually("b is picked up without a signal", async || {
        model_names(&router)
            .await
            .contains(&"qwen2.5:14b".to_string())
    })
    .await;
}

#[tokio::test]
async fn sigterm_lets_streams_in_flight_finish() {
    let a = start(node_with_qwen("a")).await;
    let mut router = Router::start(
        vec![NodeSpec::of(&a, 2)],
        "grace_period_seconds: 2\ngraceful_shutdown_timeout_seconds: 5\n",
    )
    .await;
    let stream = hold(&router, "finish me", 50).await;
    router.signal("TERM");
    assert!(
        completed(stream).await,
        "the stream in flight at SIGTERM completed"
    );
    let status = router
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("corral exits after the grace period");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn graceful_upgrade_hands_the_listener_to_a_new_process() {
    let a = start(node_with_qwen("a")).await;
    let mut old = Router::start(
        vec![NodeSpec::of(&a, 2)],
        "grace_period_seconds: 2\ngraceful_shutdown_timeout_seconds: 5\n",
    )
    .await;
    let stream = hold(&old, "across the upgrade", 50).await;

    // The new process waits for the old one's listeners...
    let sock = format!("/tmp/corral-test-{}.sock", old.addr.port());
    let _ = std::fs::remove_file(&sock);
    let mut new = Command::new(env!("CARGO_BIN_EXE_corral"))
        .arg("-c")
        .arg(old.config_path())
        .arg("-u")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("new corral starts");
    // (it listens on `upgrade_sock` once it is ready)...
    eventually("the new process listens for the handover", async || {
        std::path::Path::new(&sock).exists()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ...which SIGQUIT makes the old one hand over before it drains.
    old.signal("QUIT");
    assert!(
        completed(stream).await,
        "the old process finished its stream"
    );
    old.wait_exit(Duration::from_secs(15))
        .await
        .expect("the old process exits");

    // The same address is served, by the new process.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (node, _, _) = chat(&old, &["after the upgrade".into()]).await;
    assert_eq!(node, "a");
    assert!(new.try_wait().unwrap().is_none(), "the new process runs");
    let _ = new.kill();
    let _ = new.wait();
}

/// A request keeps the configuration it arrived under for its whole life: one that waits
/// for a slot across a reload keeps its own `queue.max_wait`, while a request that arrives
/// after the reload gets the new one.
#[tokio::test]
async fn a_request_waiting_across_a_reload_keeps_the_config_it_arrived_under() {
    let mut a_cfg = fast_node("a");
    a_cfg.decode_per_token = Duration::from_millis(20);
    let a = start(a_cfg).await;
    // A node without the requests' model: adding it is a visible sign of the reload that
    // gives none of them anywhere else to go.
    let mut b_cfg = fast_node("b");
    b_cfg.models = vec![model("phi3:mini", 2.3)];
    b_cfg.preload = vec!["phi3:mini".into()];
    let b = start(b_cfg).await;
    let patient = "queue:\n  max_wait: 20s\n";
    let router = Router::start(vec![NodeSpec::of(&a, 1)], patient).await;

    // a's one slot is busy for about 3 s (150 tokens at 20 ms).
    let busy = hold(&router, "a long answer", 150).await;
    let waiting = {
        let url = format!("{}/api/chat", router.url());
        let body = chat_body(&["waits for the slot".to_string()], false);
        tokio::spawn(async move { client().post(url).json(&body).send().await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;

    let impatient = "queue:\n  max_wait: 100ms\n";
    router.rewrite_config(&[NodeSpec::of(&a, 1), NodeSpec::of(&b, 1)], impatient);
    router.signal("HUP");
    eventually("the reload is in force (b's model is listed)", async || {
        model_names(&router)
            .await
            .contains(&"phi3:mini".to_string())
    })
    .await;

    // Arriving now, under the new config: a's slot is still busy, and 100 ms is all it waits.
    let late = post_chat(&router, &chat_body(&["arrives late".to_string()], false)).await;
    assert_eq!(
        late.status(),
        503,
        "the new max_wait applies to new requests"
    );

    // The request that arrived before the reload waited under its own 20 s, and was served
    // once the slot freed.
    assert!(completed(busy).await);
    let served = waiting.await.unwrap().expect("reply");
    assert_eq!(
        served.status(),
        200,
        "it kept the max_wait it arrived under"
    );
    assert_eq!(header(&served, "x-fleet-node"), "a");
}
