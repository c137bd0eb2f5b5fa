#![allow(dead_code, missing_docs)]
use sqlx::{Connection, PgConnection, Executor};
fn assert_send<T: Send>(_: T) {}
async fn a(mut conn: PgConnection) { let _ = sqlx::raw_sql(&format!("x")).execute(&mut conn).await; }
async fn b(mut conn: PgConnection) { let sql = format!("x"); let _ = sqlx::raw_sql(&sql).execute(&mut conn).await; }
async fn c(mut conn: PgConnection) { let sql = format!("x"); let _ = conn.execute(sql.as_str()).await; }
async fn d(mut conn: PgConnection) { let _: Result<bool, _> = sqlx::query_scalar("x").bind("y").fetch_one(&mut conn).await; }
async fn e(mut conn: PgConnection) { let _ = conn.close().await; }
fn t() { assert_send(a(todo!())); }
fn u() { assert_send(b(todo!())); }
fn v() { assert_send(c(todo!())); }
fn w() { assert_send(d(todo!())); }
fn x() { assert_send(e(todo!())); }
