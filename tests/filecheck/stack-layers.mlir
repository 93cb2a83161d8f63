// RUN: hspmd-opt %s -p stack-layers --split-input-file | filecheck %s

// Three calls of one layer function, each with its own weight and the previous call's result,
// become one graph.scan over the stacked weight "l.[0:3].w" (slice i: layer i); the per-layer
// parameters and the calls are gone.

builtin.module {
  func.func @train_step() {
    %w0 = graph.parameter "l.0.w" {init = "normal:0.02"} : tensor<4x4xf32>
    %w1 = graph.parameter "l.1.w" {init = "normal:0.02"} : tensor<4x4xf32>
    %w2 = graph.parameter "l.2.w" {init = "normal:0.02"} : tensor<4x4xf32>
    %x = graph.input "x" : tensor<2x4xf32>
    %h1 = func.call @Layer_0(%w0, %x) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %h2 = func.call @Layer_0(%w1, %h1) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %h3 = func.call @Layer_0(%w2, %h2) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %l = graph.reduce_sum %h3 {dims = array<i64: 0, 1>} : (tensor<2x4xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
  func.func private @Layer_0(%w: tensor<4x4xf32>, %x: tensor<2x4xf32>) -> tensor<2x4xf32> {
    %y = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
    %r = graph.relu %y : (tensor<2x4xf32>) -> tensor<2x4xf32>
    func.return %r : tensor<2x4xf32>
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK-NEXT:    [[W:%.*]] = graph.parameter "l.[0:3].w" {init = "normal:0.02"} : tensor<3x4x4xf32>
// CHECK-NOT:     graph.parameter "l.
// CHECK:         [[X:%.*]] = graph.input "x"
// CHECK-NEXT:    [[H:%.*]] = graph.scan @Layer_0([[W]], [[X]]) {length = 3 : i64, stacked = array<i64: 0>, carry_args = array<i64: 1>, carry_results = array<i64: 0>} : (tensor<3x4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
// CHECK-NEXT:    graph.reduce_sum [[H]]
// CHECK-NOT:     func.call

// -----

// A weight shared by every layer (tied) is an invariant operand; the names need not start at 0.
// Names that do not count up ("a.1.w", "a.0.w") leave the calls as they are.

builtin.module {
  func.func @train_step() {
    %s = graph.parameter "shared" {init = "ones"} : tensor<4xf32>
    %w0 = graph.parameter "b.5.w" {init = "zeros"} : tensor<4x4xf32>
    %w1 = graph.parameter "b.6.w" {init = "zeros"} : tensor<4x4xf32>
    %v0 = graph.parameter "a.1.w" {init = "zeros"} : tensor<4x4xf32>
    %v1 = graph.parameter "a.0.w" {init = "zeros"} : tensor<4x4xf32>
    %x = graph.input "x" : tensor<2x4xf32>
    %h1 = func.call @L(%s, %w0, %x) : (tensor<4xf32>, tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %h2 = func.call @L(%s, %w1, %h1) : (tensor<4xf32>, tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %g1 = func.call @L(%s, %v0, %x) : (tensor<4xf32>, tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %g2 = func.call @L(%s, %v1, %g1) : (tensor<4xf32>, tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %sum = graph.add %h2, %g2 : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %l = graph.reduce_sum %sum {dims = array<i64: 0, 1>} : (tensor<2x4xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
  func.func private @L(%s: tensor<4xf32>, %w: tensor<4x4xf32>, %x: tensor<2x4xf32>) -> tensor<2x4xf32> {
    %y = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
    %b = graph.broadcast %s {dims = array<i64: 1>} : (tensor<4xf32>) -> tensor<2x4xf32>
    %z = graph.mul %y, %b : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    func.return %z : tensor<2x4xf32>
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         [[W:%.*]] = graph.parameter "b.[5:7].w" {init = "zeros"} : tensor<2x4x4xf32>
// CHECK:         graph.parameter "a.1.w"
// CHECK:         graph.parameter "a.0.w"
// CHECK:         graph.scan @L(%s, [[W]], %x) {length = 2 : i64, stacked = array<i64: 1>, carry_args = array<i64: 2>, carry_results = array<i64: 0>}
// CHECK:         func.call @L
// CHECK:         func.call @L

// -----

// A layer that draws random numbers takes a per-call counter, `step + (k << 32)`: the counters
// become one stacked operand, the step broadcast plus a graph.iota counting up by 2^32.

builtin.module {
  func.func @train_step() {
    %w0 = graph.parameter "l.0.w" {init = "zeros"} : tensor<4x4xf32>
    %w1 = graph.parameter "l.1.w" {init = "zeros"} : tensor<4x4xf32>
    %x = graph.input "x" : tensor<2x4xf32>
    %step = graph.input "step" : tensor<i64>
    %c0 = graph.constant {value = 0.000000e+00 : f64} : tensor<i64>
    %k0 = graph.add %step, %c0 : (tensor<i64>, tensor<i64>) -> tensor<i64>
    %h1 = func.call @L(%w0, %x, %k0) : (tensor<4x4xf32>, tensor<2x4xf32>, tensor<i64>) -> tensor<2x4xf32>
    %c1 = graph.constant {value = 4294967296.0 : f64} : tensor<i64>
    %k1 = graph.add %step, %c1 : (tensor<i64>, tensor<i64>) -> tensor<i64>
    %h2 = func.call @L(%w1, %h1, %k1) : (tensor<4x4xf32>, tensor<2x4xf32>, tensor<i64>) -> tensor<2x4xf32>
    %l = graph.reduce_sum %h2 {dims = array<i64: 0, 1>} : (tensor<2x4xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
  func.func private @L(%w: tensor<4x4xf32>, %x: tensor<2x4xf32>, %k: tensor<i64>) -> tensor<2x4xf32> {
    %y = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
    %d = graph.dropout %y, %k {rate = 1.000000e-01 : f64, seed = 0 : i64, salt = 0 : i64} : (tensor<2x4xf32>, tensor<i64>) -> tensor<2x4xf32>
    func.return %d : tensor<2x4xf32>
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK:         [[W:%.*]] = graph.parameter "l.[0:2].w"
// CHECK:         [[B:%.*]] = graph.broadcast %step {dims = array<i64>} : (tensor<i64>) -> tensor<2xi64>
// CHECK-NEXT:    [[I:%.*]] = graph.iota {start = 0 : i64, step = 4294967296 : i64} : tensor<2xi64>
// CHECK-NEXT:    [[K:%.*]] = graph.add [[B]], [[I]] : (tensor<2xi64>, tensor<2xi64>) -> tensor<2xi64>
// CHECK-NEXT:    graph.scan @L([[W]], %x, [[K]]) {length = 2 : i64, stacked = array<i64: 0, 2>, carry_args = array<i64: 1>, carry_results = array<i64: 0>}
// CHECK-NOT:     func.call
// CHECK-NOT:     graph.constant

// -----

// Two layer functions taking turns (sliding and full attention): one function makes a period's
// calls, and a scan runs it; each weight is stacked over every other layer.

builtin.module {
  func.func @train_step() {
    %w0 = graph.parameter "h.0.w" {init = "zeros"} : tensor<4x4xf32>
    %w1 = graph.parameter "h.1.w" {init = "zeros"} : tensor<4x4xf32>
    %w2 = graph.parameter "h.2.w" {init = "zeros"} : tensor<4x4xf32>
    %w3 = graph.parameter "h.3.w" {init = "zeros"} : tensor<4x4xf32>
    %x = graph.input "x" : tensor<2x4xf32>
    %h0 = func.call @A(%w0, %x) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %h1 = func.call @B(%w1, %h0) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %h2 = func.call @A(%w2, %h1) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %h3 = func.call @B(%w3, %h2) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %l = graph.reduce_sum %h3 {dims = array<i64: 0, 1>} : (tensor<2x4xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
  func.func private @A(%w: tensor<4x4xf32>, %x: tensor<2x4xf32>) -> tensor<2x4xf32> {
    %y = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
    func.return %y : tensor<2x4xf32>
  }
  func.func private @B(%w: tensor<4x4xf32>, %x: tensor<2x4xf32>) -> tensor<2x4xf32> {
    %y = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
    %z = graph.tanh %y : (tensor<2x4xf32>) -> tensor<2x4xf32>
    func.return %z : tensor<2x4xf32>
  }
}

// CHECK-LABEL: func.func @train_step
// CHECK-DAG:     [[A:%.*]] = graph.parameter "h.[0:4:2].w" {init = "zeros"} : tensor<2x4x4xf32>
// CHECK-DAG:     [[B:%.*]] = graph.parameter "h.[1:5:2].w" {init = "zeros"} : tensor<2x4x4xf32>
// CHECK:         graph.scan @A_period2([[A]], %x, [[B]]) {length = 2 : i64, stacked = array<i64: 0, 2>, carry_args = array<i64: 1>, carry_results = array<i64: 0>}
// CHECK-NOT:     func.call
// CHECK:         func.func private @A_period2(%[[W0:.*]]: tensor<4x4xf32>, %[[X:.*]]: tensor<2x4xf32>, %[[W1:.*]]: tensor<4x4xf32>)
// CHECK-NEXT:      %[[H:.*]] = func.call @A(%[[W0]], %[[X]])
// CHECK-NEXT:      %[[Y:.*]] = func.call @B(%[[W1]], %[[H]])
// CHECK-NEXT:      func.return %[[Y]]
